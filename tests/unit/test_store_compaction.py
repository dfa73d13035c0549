"""The journal compacts itself while records change, off the loop, and loses
nothing: a restart reads the snapshot and what came after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cni_agent.sandboxes import store as store_module
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore, recorded


def _record(i: int, phase: Phase = Phase.READY) -> SandboxRecord:
    return SandboxRecord(f"s{i}", f"/run/netns/s{i}", None, (
        Attachment("pods", "eth0", b'{"cniVersion":"1.0.0","name":"pods","plugins":[{}]}',
                   phase=phase, result={"ips": [{"address": f"10.1.{i // 250}.{i % 250}/16"}]}),))


async def test_records_survive_compactions_while_they_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_module, "COMPACT_MIN", 16 * 1024)  # compact often
    store = SandboxStore(str(tmp_path))
    store.open()
    for round_ in range(30):  # a churn of sandboxes: set up, some torn down
        for i in range(20):
            store.write(_record(round_ * 20 + i, Phase.ADDING))
            store.write(_record(round_ * 20 + i))
        for i in range(0, 20, 2):
            store.delete(f"s{round_ * 20 + i}")
        await store.commit()
        await asyncio.sleep(0)  # let a compaction run
    if store._compaction is not None:
        await store._compaction  # the last one under way
    live = {r.sandbox_id for r in store.records()}
    assert len(live) == 300
    snapshots = sorted((tmp_path / "journal").glob("snapshot-*"))
    assert snapshots, "no compaction happened"
    logs = sorted((tmp_path / "journal").glob("log-*"))
    assert len(logs) <= 3  # the ones a snapshot covers are gone
    await store.close()
    assert set(recorded(str(tmp_path))) == live
    again = SandboxStore(str(tmp_path))
    again.open()
    assert {r.sandbox_id for r in again.records()} == live
    assert all(r.attachments[0].result for r in again.records())
    again.shutdown()
