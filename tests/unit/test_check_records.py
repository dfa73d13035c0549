"""An attachment's check state lives in its sandbox record: it round-trips,
and records written before it existed still load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cni_agent.sandboxes.records import (
    Attachment,
    CheckState,
    CheckVerdict,
    DamagedRecord,
    Phase,
    SandboxRecord,
    SandboxStore,
    StateUnavailable,
)

# A record as 0.2 wrote it: no "check" key anywhere.
OLD = {"version": 1, "sandbox": "pod", "netns": "/run/netns/pod", "netnsId": None,
       "phase": "ready", "request": "", "updated": 1.0, "owner": 0,
       "attachments": [{"network": "pods", "ifname": "eth0", "config": "e30=", "args": [],
                        "capabilities": {}, "phase": "ready"}]}


def test_a_record_without_check_state_loads_unchecked(tmp_path: Path) -> None:
    store = SandboxStore(str(tmp_path))
    Path(store.dir).mkdir(parents=True)
    Path(store.path("pod")).write_text(json.dumps(OLD))
    rec = store.read("pod")
    assert rec is not None and rec.attachments[0].check is None


def test_check_state_round_trips_through_the_store(tmp_path: Path) -> None:
    store = SandboxStore(str(tmp_path))
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY)
    state = CheckState(CheckVerdict.DRIFTED, 12.5, "could not check ipv4 dnat", True, 2)
    rec = SandboxRecord("pod", "/run/netns/pod", None, (att,)).with_check("eth0", state)
    store.write(rec)
    back = store.read("pod")
    assert back is not None and back.attachments[0].check == state
    # Older agents read attachments key by key: the new key is one they ignore.
    doc = json.loads(Path(store.path("pod")).read_text())
    assert doc["version"] == 1 and doc["attachments"][0]["check"]["verdict"] == "drifted"


def test_only_what_a_record_holds_makes_it_damaged(tmp_path: Path) -> None:
    """A read that fails (here EISDIR, as deterministic as an EMFILE or EIO is
    not) says nothing of the content: the record is unavailable now, listed
    apart from the damaged ones, and raises StateUnavailable (issue 36)."""
    store = SandboxStore(str(tmp_path))
    Path(store.dir).mkdir(parents=True)
    Path(store.path("good")).write_text(json.dumps({**OLD, "sandbox": "good"}))
    Path(store.path("empty")).write_text("")
    Path(store.path("odd")).mkdir()
    listing = store.scan()
    assert [r.sandbox_id for r in listing.records] == ["good"]
    assert (listing.damaged, listing.unavailable) == (["empty"], ["odd"])
    assert store.all() == (listing.records, ["empty"])
    with pytest.raises(StateUnavailable, match="left in place"):
        store.read("odd")
    with pytest.raises(DamagedRecord):
        store.read("empty")
