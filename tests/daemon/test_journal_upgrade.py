"""An upgrade from an agent before the journal keeps every live sandbox.

Agents before the journal kept one record file per sandbox,
`state_dir/sandboxes/ID.json`, and the results in the libcni cache only.
The new agent imports those files at start-up (docs/reliability.md, "The
journal"): live sandboxes keep their addresses and can be shown and torn
down, an interrupted Setup is rolled back, and the files are gone once the
journal holds them. Real bridge + host-local, real namespaces.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.net import addresses, allocations
from tests.support.plugins import Control, seen_netns
from tests.support.state import record, records

pytestmark = pytest.mark.root


def _as_an_older_agent_left_it(state: Path, interrupted: dict[str, object]) -> None:
    """The journal replaced by what an agent before it wrote: one file per
    sandbox (no results in them), the cache entries as they are."""
    legacy = state / "sandboxes"
    legacy.mkdir(exist_ok=True)
    for sid, doc in records(state).items():
        for a in doc["attachments"]:  # type: ignore[union-attr]
            a.pop("result", None)
        (legacy / f"{sid}.json").write_text(json.dumps(doc))
    (legacy / "c.json").write_text(json.dumps(interrupted))
    shutil.rmtree(state / "journal")


def test_an_upgrade_keeps_the_live_sandboxes_of_an_agent_before_the_journal(
    make_agent: Callable[..., Agent], bridge_chain: str, control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    agent = make_agent()
    a, b, c = netns_factory(), netns_factory(), netns_factory()
    agent.setup("a", a)
    agent.setup("b", b)
    before = {ns: addresses(ns) for ns in (a, b)}
    shown = json.loads(agent.call("Show", "s", "a")[0])
    assert agent.stop() == 0
    # c: a Setup the older agent was killed in before its first plugin ran.
    doc_b = record(state, "b")
    assert doc_b is not None
    interrupted = {**doc_b, "sandbox": "c", "netns": c, "phase": "adding", "request": "",
                   "attachments": [{**att, "phase": "adding", "result": None}
                                   for att in doc_b["attachments"]]}
    _as_an_older_agent_left_it(state, interrupted)
    control.reset_records()

    agent.start()
    assert agent.call("WaitReady", "d", "10")[0] is True
    assert sorted(agent.call("ListSandboxes")[0]) == ["a", "b"]
    assert {ns: addresses(ns) for ns in (a, b)} == before
    assert json.loads(agent.call("Show", "s", "a")[0])["attachments"] == shown["attachments"]
    assert not list((state / "sandboxes").glob("*.json"))  # imported, then removed
    assert sorted(records(state)) == ["a", "b"]
    doc_a = record(state, "a")
    assert doc_a is not None and doc_a["attachments"][0]["result"]  # taken from the cache
    # The interrupted Setup was rolled back: its DEL ran, its record is gone.
    dels = {r["env"]["CNI_CONTAINERID"]: seen_netns(r) for r in control.records()
            if r["command"] == "DEL"}
    assert set(dels) == {"c"}
    # Torn down through the new agent: the addresses go back to host-local.
    for sid, ns in (("a", a), ("b", b)):
        agent.call("Teardown", "ssa{sv}", sid, ns, "0")
        assert addresses(ns) == []
    assert allocations(tmp_path / "ipam", "pods") == []
    assert records(state) == {}
