"""Per-sandbox generation numbers in the journal (issue 47, item 4): every
new record of an id gets a number larger than any given before, kept while
the record changes, across restarts, deletions and compactions; a journal
without them (an older agent's) still reads, its records at 0."""

from __future__ import annotations

import json
from pathlib import Path

from cni_agent.node import applog
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore

CONFIG = b'{"cniVersion":"1.0.0","name":"pods","plugins":[{}]}'


def _record(sid: str, phase: Phase = Phase.READY) -> SandboxRecord:
    return SandboxRecord(sid, f"/run/netns/{sid}", None,
                         (Attachment("pods", "eth0", CONFIG, phase=phase),))


def _open(tmp_path: Path) -> SandboxStore:
    store = SandboxStore(str(tmp_path))
    store.open()
    return store


async def test_a_new_record_gets_a_new_generation_kept_while_it_changes(tmp_path: Path) -> None:
    store = _open(tmp_path)
    store.write(_record("a", Phase.ADDING))
    first = store.generation("a")
    assert first > 0
    store.write(_record("a"))  # the caller's copy has none: the record's is kept
    store.mark_deleting(_record("a"), ["eth0"])
    assert store.generation("a") == first
    store.write(_record("b"))
    assert store.generation("b") > first
    store.delete("a")
    assert store.generation("a") == 0
    store.write(_record("a"))  # the id set up again: a later generation
    assert store.generation("a") > store.generation("b")
    await store.commit()
    await store.close()


async def test_generations_survive_a_restart_a_deletion_and_a_compaction(tmp_path: Path) -> None:
    store = _open(tmp_path)
    store.write(_record("a"))
    store.write(_record("b"))
    highest = store.generation("b")
    store.delete("b")  # the highest's record is gone: its end line keeps the number
    await store.close()
    again = _open(tmp_path)
    assert again.generation("a") == highest - 1
    again.write(_record("c"))
    assert again.generation("c") == highest + 1
    again.delete("c")
    again.compact_soon()  # a snapshot of the live records only: "a"
    assert again._compaction is not None
    await again._compaction
    await again.close()
    third = _open(tmp_path)
    third.write(_record("d"))
    assert third.generation("d") == highest + 2
    third.shutdown()


async def test_a_journal_without_generations_reads_with_generation_0(tmp_path: Path) -> None:
    """An older agent's lines: no "generation" key; its sandboxes keep working."""
    log, _ = applog.AppendLog.open(str(tmp_path / "journal"), str(tmp_path / "damaged"))
    doc = _record("old").to_json()
    assert "generation" not in doc or doc.pop("generation")
    log.append(json.dumps(doc).encode())
    log.sync_now()
    log.close()
    store = _open(tmp_path)
    assert store.read("old") is not None and store.generation("old") == 0
    store.write(_record("new"))
    assert store.generation("new") == 1
    # A queued DEL names it: it gets a generation now (and keeps it).
    assert store.stamp("old") == 2 and store.stamp("old") == 2
    assert store.stamp("absent") == 0
    store.shutdown()
    again = _open(tmp_path)
    assert again.generation("old") == 2
    again.shutdown()
