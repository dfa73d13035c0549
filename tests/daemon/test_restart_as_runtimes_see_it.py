"""A restart is not a network outage to a runtime: what STATUS through the shim
answers while the agent drains, stops and starts again.

The runtime is the real shim exec'd as libcni execs it, polling STATUS as
containerd 2.x does for CRI NetworkReady; the agent is a real process on the
private bus. Each test runs with the shim on the agent's socket (no bus behind
it, so every answer is the socket's) and on the bus: the same answers. (Under a
real systemd, where bus activation holds calls across the restart, make
test-systemd measures the whole gap.)
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.conftest import plug
from tests.support.agent import NAME, Agent
from tests.support.plugins import Control, wait_for
from tests.support.shim import Reply, Way, shim_conf

pytestmark = pytest.mark.root


class Poller:
    """STATUS through the shim every 0.1 s in a thread; every answer with its end time."""

    def __init__(self, agent: Agent, way: Way) -> None:
        self.shim = way.shim(agent)
        self.answers: list[tuple[float, Reply]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            reply = self.shim("STATUS", shim_conf("pods"))
            self.answers.append((time.monotonic(), reply))
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_status_poller_neither_holds_the_stop_up_nor_sees_the_drain_as_an_outage(
    make_agent: Callable[..., Agent], way: Way, testnet: Callable[..., Path],
) -> None:
    testnet()
    agent = make_agent(shutdown_drain=10.0)
    shim = way.shim(agent)
    poller = Poller(agent, way)
    try:
        wait_for(lambda: len(poller.answers) >= 3)
        assert agent.proc is not None and agent.notify is not None
        t0 = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        agent.notify.wait_for("STOPPING=1")
        # Draining: D-Bus readers are told the agent is going (NetworkReady false),
        # while a runtime asking whether it may ADD is told yes: ADDs are still served.
        assert agent.prop("NetworkReady") is False
        during = shim("STATUS", shim_conf("pods"))
        assert during.rc == 0, during
        assert agent.proc.wait(30) == 0
        stopped_after = time.monotonic() - t0
    finally:
        poller.stop()
    # The polls were no activity: the drain ended after its quiet second, not
    # after shutdown_drain (before, each poll restarted the quiet time).
    assert stopped_after < 5.0, stopped_after
    assert "the drain ends after" in agent.log()
    # Through the drain the answers stayed "ready"; only in the moment between
    # its end and the exit did the agent say it is going ("shutting down"),
    # and once gone the shim says so itself (code 11: try again later).
    after = [r for t, r in poller.answers if t > t0]
    assert sum(r.rc == 0 for r in after) >= 5, [r.out for r in after]
    unexpected = [r.out for r in after if r.rc and not (
        r.code == 11 or (r.code == 50 and r.out["msg"] == "shutting down"))]
    assert not unexpected and all(r.rc == 0 for _, r in poller.answers if _ <= t0), unexpected


def test_after_the_drain_status_says_the_agent_is_shutting_down(
    make_agent: Callable[..., Agent], way: Way, testnet: Callable[..., Path], control: Control,
    netns: str,
) -> None:
    testnet()
    agent = make_agent(shutdown_drain=1.0)
    shim = way.shim(agent)
    control.set("ADD", "succeed", sleep=3.0)
    slow = agent.busctl_bg("Setup", "ssa{sv}", "slow", netns, "0")  # keeps the agent up
    wait_for(lambda: "ADD" in control.commands())
    assert agent.proc is not None and agent.notify is not None
    agent.proc.send_signal(signal.SIGTERM)
    agent.notify.wait_for("STOPPING=1")
    assert shim("STATUS", shim_conf("pods")).rc == 0
    # The drain is over (shutdown_drain): new Setups are refused, STATUS says so too.
    wait_for(lambda: "waiting for 1 request(s) in flight" in agent.log(), timeout=10)
    assert "ShuttingDown" in agent.gdbus("Setup", "late", netns, "{}").stderr
    after = shim("STATUS", shim_conf("pods"))
    assert after.code == 50 and after.out["msg"] == "shutting down", after
    # A runtime's ADD now: try again later (ShuttingDown), on either way.
    late = shim("ADD", shim_conf("pods"), cid="late", netns=netns)
    assert late.code == 11 and late.out["msg"].startswith("cni-agent is shutting down"), late
    slow.communicate(timeout=30)
    assert slow.returncode == 0 and agent.proc.wait(30) == 0


def _start_and_ask_status_at_once(agent: Agent, way: Way) -> Reply:
    """Start the agent and send STATUS as soon as it owns its name (what bus
    activation does with the calls held during a restart), or, on the socket
    way, as soon as the socket is there."""
    agent.start(wait=False)

    def owned() -> bool:
        out = subprocess.run(["busctl", f"--address={agent.bus.address}", "--json=short",
                              "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
                              "org.freedesktop.DBus", "NameHasOwner", "s", NAME],
                             capture_output=True, text=True)
        return '"data":[true]' in out.stdout

    wait_for(owned if way.name == "bus" else agent.shim_socket.exists, timeout=20,
             interval=0.005)
    return way.shim(agent)("STATUS", shim_conf("pods"))


def test_a_status_at_start_up_waits_for_the_first_verdict(
    make_agent: Callable[..., Agent], way: Way, testnet: Callable[..., Path], control: Control,
) -> None:
    """Not "not checked yet": a runtime asking the moment the agent is back gets
    the network's answer (the first STATUS of its plugins takes 1 s here)."""
    testnet(plugins=[plug(control)])
    control.set("STATUS", "succeed", sleep=1.0)
    agent = make_agent(start=False)
    reply = _start_and_ask_status_at_once(agent, way)
    assert reply.rc == 0, reply
    assert agent.prop("NetworkReady") is True

    # A network failing at start-up: its own failure, once known.
    assert agent.stop() == 0
    control.set("STATUS", "fail", code=50, msg="the uplink is down", sleep=1.0)
    reply = _start_and_ask_status_at_once(agent, way)
    assert reply.code == 50 and "the uplink is down" in reply.out["msg"], reply


def test_a_status_at_start_up_is_answered_within_timeouts_status_when_no_verdict_comes(
    make_agent: Callable[..., Agent], way: Way, testnet: Callable[..., Path], control: Control,
) -> None:
    """The wait for the first verdict is bounded: a network whose first STATUS
    hangs gets the runtime an answer (not ready), not a call that never returns."""
    testnet(plugins=[plug(control)])
    control.set("STATUS", "hang")
    agent = make_agent(start=False, timeouts={"ready": 2, "lock": 5, "status": 1})
    reply = _start_and_ask_status_at_once(agent, way)
    assert reply.code == 50, reply
    assert agent.prop("NetworkReady") is False
