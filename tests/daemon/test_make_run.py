"""`make run`, as a newcomer runs it: start, paste the printed commands, Ctrl-C, nothing left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.agent import REPO
from tests.support.plugins import wait_for

pytestmark = pytest.mark.root


def _processes(pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return out.stdout.split()


def test_make_run_shows_it_working_and_cleans_up_on_ctrl_c(fallback_bridge: None) -> None:
    proc = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "ready — the agent's log follows" in line or time.monotonic() > deadline:
                break
        text = "\n".join(lines)
        assert "ready — the agent's log follows" in text, text
        address = re.search(r"has address (10\.234\.0\.\d+)/24", text)
        assert address, text
        netns = re.search(r"in netns (cni-agent-demo-\d+)", text)
        assert netns is not None
        workdir = re.search(r"unix:path=(/tmp/cni-agent-dev-[^/]+)/bus\.sock", text)
        assert workdir is not None
        shown = subprocess.run(["ip", "-n", netns.group(1), "-br", "addr"], capture_output=True,
                               text=True).stdout
        assert address.group(1) in shown
        commands = [line.split("$ ", 1)[1] for line in lines if line.startswith("  $ ")]
        assert len(commands) >= 5
        for cmd in commands:
            out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, f"{cmd}: {out.stderr}"
            if "ListSandboxes" in cmd:
                assert '"demo"' in out.stdout
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        rest = proc.stdout.read()
        proc.wait(90)
    finally:
        if proc.poll() is None:  # a failed assertion: still let it clean up
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert "left nothing behind" in rest, rest
    assert "NOT CLEAN" not in rest
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "cni-agent-demo-" not in after
    assert subprocess.run(["ip", "link", "show", "cniagent0"], capture_output=True).returncode != 0
    assert not _processes(r"cni-agent-dev-.*agent\.yaml")
    assert not _processes(r"dbus-daemon --config-file=/tmp/cni-agent-dev-")
    assert not Path(workdir.group(1)).exists()


def test_make_run_cleans_up_when_its_output_pipe_is_gone(fallback_bridge: None) -> None:
    """`make run | tee run.log`, then Ctrl-C: tee dies first, the cleanup must not."""
    proc = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    text = ""
    try:
        for line in proc.stdout:
            text += line
            if "ready — the agent's log follows" in line:
                break
        netns = re.search(r"in netns (cni-agent-demo-\d+)", text)
        workdir = re.search(r"unix:path=(/tmp/cni-agent-dev-[^/]+)/bus\.sock", text)
        assert netns is not None and workdir is not None, text
        proc.stdout.close()  # the reader (tee) is gone: every later write gets EPIPE
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # make itself may die first (its "Interrupt" message meets the closed pipe:
    # SIGPIPE), so the script's cleanup is waited for by what it leaves.
    wait_for(lambda: not Path(workdir.group(1)).exists(), timeout=90)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns.group(1) not in after
    assert subprocess.run(["ip", "link", "show", "cniagent0"], capture_output=True).returncode != 0
    assert not _processes(r"cni-agent-dev-.*agent\.yaml")
    assert not _processes(r"dbus-daemon --config-file=/tmp/cni-agent-dev-")
