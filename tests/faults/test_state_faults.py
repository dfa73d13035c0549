"""The agent's own resources failing (issue 36, item 4): only damaged content is quarantined.

A read of a sandbox record that failed for a reason that can pass (EMFILE,
the agent out of descriptors) used to count as a damaged record: it was
moved to `damaged/` for good, and with it the owner, the namespace's
identity and the check state. Records are read from the journal's memory
now, so no read can fail that way; the agent out of descriptors fails the
one operation with a named error, sets nothing aside, and loses nothing of
the record.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.state import record

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


def lowest_free_fd(pid: int) -> int:
    used = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(fd for fd in range(len(used) + 1) if fd not in used)


def test_a_record_that_cannot_be_read_now_is_left_in_place(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str, tmp_path: Path,
) -> None:
    testnet()
    # Nothing runs unasked (no STATUS poll, reaping or CHECK pass opening
    # descriptors): the Teardown below is the only thing the agent does.
    agent = make_agent(monitor={"startup_interval": 0.05, "interval": 3600},
                       gc={"interval": 0}, check={"interval": 0})
    agent.setup("st1", netns)
    agent.call("CheckSandboxes", "as", "1", "st1")  # a check state in the record
    state = tmp_path / "state"
    before = record(state, "st1")
    assert before and before["netnsId"] and before["attachments"][0]["check"]["verdict"] == "ok"

    # One free descriptor slot: a Teardown's lock file takes it (its netns ""
    # opens none), and what needs one next (the plugin's pipes) fails with EMFILE.
    assert agent.proc is not None
    pid = agent.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid) + 1, hard))
    try:
        out = agent.gdbus("Teardown", "st1", "", "{}", timeout=30)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert out.returncode != 0, out
    assert ERR in out.stderr and "Too many open files" in out.stderr, out.stderr
    # Nothing was set aside: owner, identity and checks are as they were.
    after = record(state, "st1")
    assert after is not None
    for key in ("owner", "netns", "netnsId"):
        assert after[key] == before[key], key
    assert after["attachments"][0]["check"] == before["attachments"][0]["check"]
    assert not (state / "sandboxes" / "damaged").exists()
    # The limit back, the same call works.
    agent.call("Teardown", "ssa{sv}", "st1", "", "0")
    assert record(state, "st1") is None and agent.call("ListSandboxes")[0] == []
