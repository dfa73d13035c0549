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
    Lost,
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
    store = SandboxStore(str(tmp_path))
    state = CheckState(verdict, 3.0, "why", passed, 1, "what the repair did")
    rec = SandboxRecord("pod", "/run/netns/pod", None,
                        (Attachment("pods", "eth0", b"{}", phase=Phase.READY),)
                        ).with_check("eth0", state)
    store.write(rec)
    doc = json.loads(Path(store.path("pod")).read_text())
    check = doc["attachments"][0]["check"]
    assert check["verdict"] == compat and compat in OLD_VERDICTS
    assert check["state"] == str(verdict) and doc["version"] == 1
    back = store.read("pod")
    assert back is not None and back.attachments[0].check == state


def test_a_lost_attachment_round_trips_and_an_unknown_state_is_no_damage(tmp_path: Path) -> None:
    store = SandboxStore(str(tmp_path))
    lost = Lost(10.0, "plugin testplug ADD failed (code 11): no room", 3, 70.0,
                ("10.92.6.2/24",), "0a:58:0a:5c:06:02")
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY, lost=lost)
    store.write(SandboxRecord("pod", "/run/netns/pod", None, (att,)))
    back = store.read("pod")
    assert back is not None and back.attachments[0].lost == lost
    # A check state a later agent wrote: its "verdict" is read, the record is no damage.
    doc = json.loads(Path(store.path("pod")).read_text())
    doc["attachments"][0]["check"] = {"verdict": "drifted", "state": "from-the-future", "at": 1}
    Path(store.path("pod")).write_text(json.dumps(doc))
    back = store.read("pod")
    assert back is not None and back.attachments[0].check is not None
    assert back.attachments[0].check.verdict is CheckVerdict.DRIFTED


def test_a_removal_the_disk_did_not_take_reads_deleting_until_a_write_records_it(
    tmp_path: Path,
) -> None:
    """The store's memory of what it could not write (a full or read-only
    state dir): every read shows those attachments being removed."""
    store = SandboxStore(str(tmp_path))
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
    on_disk = json.loads(Path(store.path("pod")).read_text())
    assert [a["phase"] for a in on_disk["attachments"]] == ["ready", "ready"]
    store.write(seen.with_attachments(seen.attachments[:1]))  # eth1's end, recorded
    back = store.read("pod")
    assert store.pending() == [] and back is not None
    assert [(a.ifname, a.phase) for a in back.attachments] == [("eth0", Phase.READY)]
    store.unrecorded("pod", ["eth0"])
    store.delete("pod")
    assert store.pending() == [] and store.read("pod") is None
