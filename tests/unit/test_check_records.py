"""An attachment's check state lives in its sandbox record: it round-trips
through the journal, and records written before it existed still load; what
an older agent's record files hold is imported once, the damaged set aside."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cni_agent.node.applog import AppendLog
from cni_agent.sandboxes.records import (
    Attachment,
    CheckState,
    CheckVerdict,
    DamagedRecord,
    Lost,
    Phase,
    SandboxRecord,
)
from cni_agent.sandboxes.store import SandboxStore, recorded


def _store(tmp: Path) -> SandboxStore:
    store = SandboxStore(str(tmp))
    store.open()
    return store


def _reopened(store: SandboxStore, tmp: Path) -> SandboxStore:
    store.shutdown()
    return _store(tmp)


def _legacy(tmp: Path, name: str) -> Path:
    """Where an agent before the journal kept a sandbox's record."""
    d = tmp / "sandboxes"
    d.mkdir(exist_ok=True)
    return d / name


# A record as 0.2 wrote it: no "check" key anywhere.
OLD = {"version": 1, "sandbox": "pod", "netns": "/run/netns/pod", "netnsId": None,
       "phase": "ready", "request": "", "updated": 1.0, "owner": 0,
       "attachments": [{"network": "pods", "ifname": "eth0", "config": "e30=", "args": [],
                        "capabilities": {}, "phase": "ready"}]}


def test_a_record_without_check_state_loads_unchecked(tmp_path: Path) -> None:
    _legacy(tmp_path, "pod.json").write_text(json.dumps(OLD))
    store = _store(tmp_path)  # imported into the journal, the file removed
    rec = store.read("pod")
    assert rec is not None and rec.attachments[0].check is None
    assert not _legacy(tmp_path, "pod.json").exists()
    assert recorded(str(tmp_path))["pod"]["attachments"][0]["phase"] == "ready"
    store = _reopened(store, tmp_path)
    assert store.read("pod") == rec


def test_check_state_round_trips_through_the_store(tmp_path: Path) -> None:
    store = _store(tmp_path)
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY)
    state = CheckState(CheckVerdict.DRIFTED, 12.5, "could not check ipv4 dnat", True, 2)
    rec = SandboxRecord("pod", "/run/netns/pod", None, (att,)).with_check("eth0", state)
    store.write(rec)
    back = _reopened(store, tmp_path).read("pod")
    assert back is not None and back.attachments[0].check == state
    # The journal's record keeps the format older agents read key by key.
    doc = recorded(str(tmp_path))["pod"]
    assert doc["version"] == 1 and doc["attachments"][0]["check"]["verdict"] == "drifted"


def test_only_what_a_record_holds_makes_it_damaged(tmp_path: Path) -> None:
    """An older agent's record files: the good one is imported, the empty one
    (a power loss on XFS) set aside, one that cannot be read now (here
    EISDIR, as deterministic as an EMFILE or EIO is not) left in place and
    imported at a later start; in the journal, a record an unknown phase
    makes unusable is damaged (issue 36)."""
    _legacy(tmp_path, "good.json").write_text(json.dumps({**OLD, "sandbox": "good"}))
    _legacy(tmp_path, "empty.json").write_text("")
    _legacy(tmp_path, "odd.json").mkdir()
    store = SandboxStore(str(tmp_path))
    notes = store.open()
    assert [r.sandbox_id for r in store.scan().records] == ["good"]
    assert store.read("empty") is None and store.read("odd") is None
    assert (tmp_path / "sandboxes" / "damaged" / "empty.json").read_text() == ""
    assert _legacy(tmp_path, "odd.json").is_dir() and not _legacy(tmp_path, "good.json").exists()
    assert any("empty.json is damaged" in n for n in notes), notes
    assert any("odd.json now" in n and "next start" in n for n in notes), notes
    store.shutdown()
    # A record only a newer agent can read, in the journal itself.
    log, _ = AppendLog.open(str(tmp_path / "journal"), str(tmp_path / "damaged"))
    log.append(json.dumps({**OLD, "sandbox": "future", "phase": "migrating",
                           "attachments": []}).encode())
    log.close()
    os.rmdir(_legacy(tmp_path, "odd.json"))
    store = _store(tmp_path)
    with pytest.raises(DamagedRecord):
        store.read("future")
    assert store.scan().damaged == ["future"]
    kept = store.set_aside("future")
    assert json.loads(Path(kept).read_text())["phase"] == "migrating"
    assert store.read("future") is None
    assert _reopened(store, tmp_path).scan().damaged == []  # set aside for good


# What an agent before issue 36 reads of a check state: the four verdicts it knows.
OLD_VERDICTS = {"ok", "drifted", "unsupported", "disabled"}


@pytest.mark.parametrize("verdict, passed, compat", [
    (CheckVerdict.FAILED_TO_RUN, True, "ok"),
    (CheckVerdict.FAILED_TO_RUN, False, "unsupported"),
    (CheckVerdict.NEW_ADDRESS, True, "ok"),
    (CheckVerdict.LOST, True, "drifted"),
])
def test_new_check_states_are_kept_where_older_agents_do_not_look(
    tmp_path: Path, verdict: CheckVerdict, passed: bool, compat: str,
) -> None:
    """An older agent parses "verdict" as one of its four (anything else would
    make the whole record damaged to it); the full state is in "state"."""
    store = _store(tmp_path)
    state = CheckState(verdict, 3.0, "why", passed, 1, "what the repair did")
    rec = SandboxRecord("pod", "/run/netns/pod", None,
                        (Attachment("pods", "eth0", b"{}", phase=Phase.READY),)
                        ).with_check("eth0", state)
    store.write(rec)
    doc = recorded(str(tmp_path))["pod"]
    check = doc["attachments"][0]["check"]
    assert check["verdict"] == compat and compat in OLD_VERDICTS
    assert check["state"] == str(verdict) and doc["version"] == 1
    back = _reopened(store, tmp_path).read("pod")
    assert back is not None and back.attachments[0].check == state


def test_a_lost_attachment_round_trips_and_an_unknown_state_is_no_damage(tmp_path: Path) -> None:
    store = _store(tmp_path)
    lost = Lost(10.0, "plugin testplug ADD failed (code 11): no room", 3, 70.0,
                ("10.92.6.2/24",), "0a:58:0a:5c:06:02")
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY, lost=lost)
    store.write(SandboxRecord("pod", "/run/netns/pod", None, (att,)))
    store = _reopened(store, tmp_path)
    back = store.read("pod")
    assert back is not None and back.attachments[0].lost == lost
    store.shutdown()
    # A check state a later agent wrote: its "verdict" is read, the record is no damage.
    doc = recorded(str(tmp_path))["pod"]
    doc["attachments"][0]["check"] = {"verdict": "drifted", "state": "from-the-future", "at": 1}
    log, _ = AppendLog.open(str(tmp_path / "journal"), str(tmp_path / "damaged"))
    log.append(json.dumps(doc).encode())
    log.close()
    back = _store(tmp_path).read("pod")
    assert back is not None and back.attachments[0].check is not None
    assert back.attachments[0].check.verdict is CheckVerdict.DRIFTED


def test_a_removal_the_disk_did_not_take_reads_deleting_until_a_write_records_it(
    tmp_path: Path,
) -> None:
    """The store's memory of what it could not write (a full or read-only
    state dir): every read shows those attachments being removed."""
    store = _store(tmp_path)
    rec = SandboxRecord("pod", "/run/netns/pod", None, (
        Attachment("pods", "eth0", b"{}", phase=Phase.READY),
        Attachment("pods", "eth1", b"{}", phase=Phase.READY)))
    store.write(rec)
    store.unrecorded("pod", ["eth1"])
    seen = store.read("pod")
    assert seen is not None and seen.phase is Phase.DELETING
    assert [a.phase for a in seen.attachments] == [Phase.READY, Phase.DELETING]
    assert [r.phase for r in store.all()[0]] == [Phase.DELETING]
    assert store.pending() == ["pod"]
    # On disk it still says ready: what was not written is not pretended.
    on_disk = recorded(str(tmp_path))["pod"]
    assert [a["phase"] for a in on_disk["attachments"]] == ["ready", "ready"]
    store.write(seen.with_attachments(seen.attachments[:1]))  # eth1's end, recorded
    back = store.read("pod")
    assert store.pending() == [] and back is not None
    assert [(a.ifname, a.phase) for a in back.attachments] == [("eth0", Phase.READY)]
    store.unrecorded("pod", ["eth0"])
    store.delete("pod")
    assert store.pending() == [] and store.read("pod") is None
    assert "pod" not in recorded(str(tmp_path))
