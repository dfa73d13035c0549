"""A plugin's leftover that cleared its environment is still the agent's to end.

The agent is a child subreaper: what a plugin leaves running comes back to it
as a child. It attributes such a child to a plugin run by session, process
group or the run's token in the child's environment (cni/leftovers.py). A
daemon that starts in a session of its own with a clean environment (`setsid
env -i ...`, a Go helper with `cmd.Env` set, a daemon that rewrites its
environ for its title) carries none of the three. Issue 36: "whatever the
plugin left running, in its group or another session, is ended when its call
ends."

The plugin here is a small shell script of this test's own (the suite's test
plugin leaves its daemon with the agent's environment): ADD starts `sleep`
that way, not holding stdout, and prints a valid result.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.plugins import alive, conflist, wait_for, write_conf

pytestmark = pytest.mark.root

LEAVER = """#!/bin/sh
# ADD: leave /bin/sleep in a session of its own, with an empty environment.
cat >/dev/null
case "$CNI_COMMAND" in
ADD)
    # A subshell in between: the daemon is an orphan (the agent's) at once.
    ( setsid env -i /bin/sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile} && \
exec /bin/sleep 300' </dev/null >/dev/null 2>&1 & )
    while [ ! -s {pidfile} ]; do sleep 0.01; done
    # With a hold file: stay in flight until it goes, then fail unless the
    # leftover (which this run still needs) is alive.
    while [ -e {pidfile}.hold ]; do sleep 0.01; done
    kill -0 "$(cat {pidfile})" || {{ printf '{{"code":11,"msg":"my helper was killed"}}'; exit 1; }}
    printf '{{"cniVersion":"1.0.0","interfaces":[{{"name":"%s","sandbox":"%s"}}],"ips":[]}}' \
        "$CNI_IFNAME" "$CNI_NETNS"
    ;;
VERSION)
    printf '{{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}}'
    ;;
esac
exit 0
"""


def zombies(agent: Agent) -> list[str]:
    assert agent.proc is not None
    ps = subprocess.run(["ps", "--ppid", str(agent.proc.pid), "-o", "pid=,stat=,comm="],
                        capture_output=True, text=True)
    return [line for line in ps.stdout.splitlines() if line.split()[1].startswith("Z")]


def test_a_leftover_with_a_clean_environment_in_its_own_session_is_ended(
    make_agent: Callable[..., Agent], tmp_path: Path, netns: str,
) -> None:
    pidfile = tmp_path / "leftover.pid"
    plugin = tmp_path / "bin" / "leaver"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(LEAVER.format(pidfile=pidfile))
    os.chmod(plugin, 0o755)
    write_conf(tmp_path / "net.d", "50-leaver.conflist",
               conflist("leaver", [{"type": "leaver"}], "1.0.0"))
    agent = make_agent()
    assert agent.proc is not None
    left = 0
    try:
        agent.setup("s1", netns)
        left = int(pidfile.read_text())
        # Ended as the call ended, as the suite's own daemonizing plugin's leftover is
        # (tests/faults/test_plugin_leftovers.py: gone within 5 s), and named.
        wait_for(lambda: not alive(left), timeout=5)
        assert "plugin leaver ADD left 1 process(es) running, killed" in agent.log()
        wait_for(lambda: zombies(agent) == [], timeout=5)
        agent.call("Teardown", "ssa{sv}", "s1", netns, "0")
    finally:
        if left and alive(left):
            os.kill(left, signal.SIGKILL)


def test_a_run_in_flight_keeps_its_unmarked_helper_while_other_runs_end(
    make_agent: Callable[..., Agent], tmp_path: Path, netns_factory: Callable[[], str],
    testnet: Callable[..., Path],
) -> None:
    """Another run's end cannot tell whose an unmarked child is while an older run
    is in flight: it leaves it, and the run in flight gets its helper until it ends."""
    pidfile = tmp_path / "leftover.pid"
    hold = Path(f"{pidfile}.hold")
    plugin = tmp_path / "bin" / "leaver"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(LEAVER.format(pidfile=pidfile))
    os.chmod(plugin, 0o755)
    write_conf(tmp_path / "net.d", "50-leaver.conflist",
               conflist("leaver", [{"type": "leaver"}], "1.0.0"))
    testnet("quick")  # the suite's test plugin: a run that starts and ends
    agent = make_agent()
    hold.touch()
    slow: list[BaseException | dict[str, object]] = []

    def setup_slow() -> None:
        try:
            slow.append(agent.setup("slow", netns_factory(), networks=[("leaver", "eth0")]))
        except BaseException as e:  # reported below
            slow.append(e)

    runner = threading.Thread(target=setup_slow)
    runner.start()
    left = 0
    try:
        wait_for(pidfile.exists, timeout=10)
        left = int(pidfile.read_text())
        for i in range(3):  # runs that start and end while the slow one is in flight
            agent.setup(f"quick{i}", netns_factory(), networks=[("quick", "eth0")])
        assert alive(left)
        hold.unlink()
        runner.join(timeout=30)
        assert slow and isinstance(slow[0], dict), slow
        wait_for(lambda: not alive(left), timeout=5)  # its own run's end ended it
    finally:
        hold.unlink(missing_ok=True)
        runner.join(timeout=30)
        if left and alive(left):
            os.kill(left, signal.SIGKILL)
