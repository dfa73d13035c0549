"""The agent's own disk failing (issue 36, item 4): only damaged content is quarantined.

A read of a sandbox record that fails for a reason that can pass (here EMFILE,
the agent out of descriptors) used to count as a damaged record: it was moved
to `damaged/` for good, and with it the owner, the namespace's identity and
the check state. Now the one operation fails with StateError and the record
stays where it is.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent

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
    record = tmp_path / "state" / "sandboxes" / "st1.json"
    before = json.loads(record.read_text())
    assert before["netnsId"] and before["attachments"][0]["check"]["verdict"] == "ok"

    # One free descriptor slot: a Teardown's lock file takes it (its netns ""
    # opens none), and the record's read that follows fails with EMFILE.
    assert agent.proc is not None
    pid = agent.proc.pid
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid) + 1, hard))
    try:
        out = agent.gdbus("Teardown", "st1", "", "{}", timeout=30)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert out.returncode != 0, out
    assert ERR + "StateError" in out.stderr, out.stderr
    assert "Too many open files" in out.stderr and "left in place" in out.stderr, out.stderr
    # Nothing was set aside: the record is as it was, owner, identity, checks.
    assert json.loads(record.read_text()) == before
    assert not (tmp_path / "state" / "sandboxes" / "damaged").exists()
    # The limit back, the same call works.
    agent.call("Teardown", "ssa{sv}", "st1", "", "0")
    assert not record.exists() and agent.call("ListSandboxes")[0] == []
