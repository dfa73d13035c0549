"""http.listen: /healthz, /readyz and /metrics, read with curl and checked with promtool."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.agent import Agent, Bus
from tests.support.plugins import Control
from tests.support.shim import run_shim, shim_conf

PROMTOOL = shutil.which("promtool") or "/var/cache/cni-agent-tests/promtool/promtool"


def curl(sock: Path, path: str) -> tuple[int, str]:
    out = subprocess.run(["curl", "-s", "--max-time", "10", "--unix-socket", str(sock),
                          "-w", "\n%{http_code}", f"http://agent{path}"],
                         capture_output=True, text=True, check=True)
    body, _, code = out.stdout.rpartition("\n")
    return int(code), body


def samples(sock: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    code, text = curl(sock, "/metrics")
    assert code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def until(pred: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture
def http_agent(make_agent: Callable[..., Agent], testnet: Callable[..., Path],
               tmp_path: Path) -> tuple[Agent, Path]:
    testnet()
    sock = tmp_path / "metrics.sock"
    # No baseline CHECKs: the metrics must move by the test's operations alone.
    return make_agent(http={"listen": f"unix:{sock}"}, check={"interval": 0}), sock


def test_probes_follow_readiness(http_agent: tuple[Agent, Path], control: Control) -> None:
    agent, sock = http_agent
    assert curl(sock, "/healthz") == (200, "ok\n")
    code, body = curl(sock, "/readyz")
    assert (code, body) == (200, agent.prop("Status") + "\n")
    control.set("STATUS", "fail", code=50, msg="the daemon is down")
    until(lambda: agent.prop("NetworkReady") is False)
    code, body = curl(sock, "/readyz")
    assert code == 503 and "the daemon is down" in body and body == agent.prop("Status") + "\n"
    assert curl(sock, "/healthz")[0] == 200  # alive, just not ready
    control.clear("STATUS")
    until(lambda: agent.prop("NetworkReady") is True)
    assert curl(sock, "/readyz")[0] == 200
    assert curl(sock, "/nothing")[0] == 404


def test_readyz_fails_at_once_on_sigterm_while_calls_are_still_served(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, netns: str
) -> None:
    testnet()
    sock = tmp_path / "metrics.sock"
    agent = make_agent(http={"listen": f"unix:{sock}"}, shutdown_drain=3.0)
    assert curl(sock, "/readyz")[0] == 200
    assert agent.proc is not None and agent.notify is not None
    agent.proc.send_signal(signal.SIGTERM)
    until(lambda: any(line.startswith("STOPPING=1") for line in agent.notify.lines()))  # type: ignore[union-attr]
    code, body = curl(sock, "/readyz")
    assert code == 503 and body.startswith("Stopping"), body
    assert curl(sock, "/healthz")[0] == 200
    assert agent.call("ListSandboxes") == [[]]  # the drain still serves D-Bus
    assert agent.call("Teardown", "ssa{sv}", "gone", netns, "0") is None
    assert agent.proc.wait(20) == 0
    assert not sock.exists() or subprocess.run(
        ["curl", "-s", "--unix-socket", str(sock), "http://agent/healthz"]).returncode != 0


def test_metrics_move_by_exactly_the_operations_made(
    http_agent: tuple[Agent, Path], control: Control, netns_factory: Callable[[], str],
    tmp_path: Path
) -> None:
    agent, sock = http_agent
    before = samples(sock)
    a, b, c = netns_factory(), netns_factory(), netns_factory()
    agent.setup("m1", a)
    agent.setup("m2", b)
    agent.call("Teardown", "ssa{sv}", "m1", a, "0")
    control.set("ADD", "fail", code=7, msg="bad subnet")
    out = agent.gdbus("Setup", "m3", c, "{}")
    assert "Error.PluginFailed" in out.stderr, out.stderr
    after = samples(sock)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("cni_agent_operations_total", method="Setup", result="ok") == 2
    assert delta("cni_agent_operations_total", method="Teardown", result="ok") == 1
    assert delta("cni_agent_operations_total", method="Setup", result="PluginFailed") == 1
    # ADD m1, m2, m3 (failed: code 7) and the rollback DEL of m3; DEL m1.
    assert delta("cni_agent_plugin_executions_total", plugin="testplug", verb="ADD", result="ok") == 2
    assert delta("cni_agent_plugin_executions_total", plugin="testplug", verb="ADD",
                 result="code_7") == 1
    assert delta("cni_agent_plugin_executions_total", plugin="testplug", verb="DEL", result="ok") == 2
    assert delta("cni_agent_plugin_duration_seconds_count", plugin="testplug", verb="ADD") == 3
    assert after[("cni_agent_sandboxes", ())] == 1
    assert after[("cni_agent_network_ready", ())] == 1
    assert after[("cni_agent_network_status_ready", (("network", "testnet"),))] == 1
    assert delta("cni_agent_lock_wait_seconds_count") == 4
    assert delta("cni_agent_busy_refusals_total") == 0
    # End to end per method, failed calls too: the p99 of pod network set-up.
    assert delta("cni_agent_operation_duration_seconds_count", method="Setup") == 3
    assert delta("cni_agent_operation_duration_seconds_count", method="Teardown") == 1
    assert delta("cni_agent_operation_duration_seconds_sum", method="Setup") > 0
    assert after[("cni_agent_operation_duration_seconds_bucket",
                  (("le", "+Inf"), ("method", "Setup")))] >= 3
    _, text = curl(sock, "/metrics")
    # No *_created series: a timestamp per child that nobody alerts on.
    assert "_created" not in text
    metrics_file = tmp_path / "metrics.txt"
    metrics_file.write_text(text)
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_readiness_transitions_are_counted(http_agent: tuple[Agent, Path], control: Control) -> None:
    agent, sock = http_agent
    before = samples(sock)[("cni_agent_readiness_transitions_total", ())]
    control.set("STATUS", "fail", code=50, msg="down")
    until(lambda: agent.prop("NetworkReady") is False)
    until(lambda: samples(sock)[("cni_agent_network_status_ready", (("network", "testnet"),))] == 0)
    control.clear("STATUS")
    until(lambda: agent.prop("NetworkReady") is True)
    assert samples(sock)[("cni_agent_readiness_transitions_total", ())] == before + 2


def test_tcp_listen_and_a_taken_port(make_agent: Callable[..., Agent],
                                     testnet: Callable[..., Path]) -> None:
    testnet()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = make_agent(start=False, http={"listen": f"127.0.0.1:{port}"})
        agent.write_config()
        agent.start(wait=False)
        assert agent.proc is not None
        assert agent.proc.wait(20) == 1
        assert f"http.listen 127.0.0.1:{port}" in agent.log()
    agent = make_agent(http={"listen": f"127.0.0.1:{port}"})
    out = subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/healthz"], capture_output=True,
                         text=True, check=True)
    assert out.stdout == "ok\n"


def test_reaping_is_counted(http_agent: tuple[Agent, Path], netns: str) -> None:
    agent, sock = http_agent
    agent.setup("r1", netns)
    deleted = ("cni_agent_gc_attachments_total", (("how", "deleted"),))
    before = samples(sock)
    assert before[("cni_agent_sandboxes", ())] == 1
    agent.call("GarbageCollect", "as", "0")  # r1 is not among the valid: stale
    after = samples(sock)
    assert after[deleted] == before[deleted] + 1
    assert after[("cni_agent_sandboxes", ())] == 0
    assert agent.call("ListSandboxes") == [[]]


def test_healthz_fails_once_the_bus_connection_is_gone(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    tmp_path: Path, netns: str,
) -> None:
    """/healthz is 200 only while the bus connection is alive too: with the bus
    gone and a Setup still finishing, it answers 503 until the agent exits."""
    testnet()
    bus = Bus("system")
    try:
        sock = tmp_path / "metrics.sock"
        agent = make_agent(bus=bus, http={"listen": f"unix:{sock}"})
        assert curl(sock, "/healthz") == (200, "ok\n")
        control.set("ADD", "succeed", sleep=3.0)
        inflight = agent.busctl_bg("Setup", "ssa{sv}", "inflight", netns, "0")
        until(lambda: any(r["command"] == "ADD" for r in control.records()))
        os.kill(bus.pid, signal.SIGKILL)
        until(lambda: curl(sock, "/healthz")[0] == 503)
        assert curl(sock, "/healthz") == (503, "the bus connection is gone\n")
        assert agent.proc is not None and agent.proc.poll() is None  # still finishing the ADD
        inflight.communicate(timeout=30)
        assert agent.proc.wait(30) == 1  # lost the bus: exit non-zero for a restart
    finally:
        bus.stop()


def test_shim_calls_are_counted_by_command_and_result(http_agent: tuple[Agent, Path]) -> None:
    agent, sock = http_agent
    conf = shim_conf("pods", "testnet")
    assert run_shim(agent.bus.address, "STATUS", conf).rc == 0
    assert run_shim(agent.bus.address, "STATUS", shim_conf("pods", "nosuchnet")).code == 50
    assert run_shim(agent.bus.address, "ADD", conf, cid="", netns="/x").code == 4
    got = samples(sock)
    assert got[("cni_agent_shim_calls_total", (("command", "STATUS"), ("result", "ok")))] == 1
    assert got[("cni_agent_shim_calls_total", (("command", "STATUS"), ("result", "code_50")))] == 1
    assert got[("cni_agent_shim_calls_total", (("command", "ADD"), ("result", "code_4")))] == 1
    # The agent's own codes, each there from the start (an alert's increase()
    # sees the first one); a plugin's own code, passed on, is not among them.
    own = {dict(labels)["code"]: v for (name, labels), v in got.items()
           if name == "cni_agent_shim_errors_total"}
    assert own == {"1": 0, "3": 0, "4": 1, "6": 0, "7": 0, "11": 0, "50": 1, "999": 0}
    assert got[("cni_agent_state_errors_total", ())] == 0


def test_a_plugins_code_through_the_shim_is_not_the_agents(
    http_agent: tuple[Agent, Path], control: Control, netns: str
) -> None:
    agent, sock = http_agent
    control.set("ADD", "fail", code=7, msg="bad subnet")
    assert run_shim(agent.bus.address, "ADD", shim_conf("pods", "testnet"), cid="p1",
                    netns=netns).code == 7
    got = samples(sock)
    assert got[("cni_agent_shim_calls_total", (("command", "ADD"), ("result", "code_7")))] == 1
    assert got[("cni_agent_shim_errors_total", (("code", "7"),))] == 0


REASONS = ("not_checked", "no_network", "default_not_found", "default_invalid", "status_failed",
           "shutting_down", "internal_error")


def reasons(sock: Path) -> dict[str, float]:
    return {dict(labels)["reason"]: v for (name, labels), v in samples(sock).items()
            if name == "cni_agent_not_ready_reason"}


def test_not_ready_reason_names_why(http_agent: tuple[Agent, Path], control: Control,
                                    testnet: Callable[..., Path]) -> None:
    """cni_agent_not_ready_reason: every reason always there, 1 for the current
    one (none when ready), following LastError."""
    agent, sock = http_agent
    assert reasons(sock) == dict.fromkeys(REASONS, 0)
    control.set("STATUS", "fail", code=50, msg="the daemon is down")
    until(lambda: reasons(sock)["status_failed"] == 1)
    assert reasons(sock) == {**dict.fromkeys(REASONS, 0), "status_failed": 1}
    assert "the daemon is down" in agent.prop("LastError")
    control.clear("STATUS")
    until(lambda: agent.prop("NetworkReady") is True)
    assert reasons(sock) == dict.fromkeys(REASONS, 0)
    testnet().unlink()  # no network at all
    until(lambda: reasons(sock)["no_network"] == 1)
    assert sum(reasons(sock).values()) == 1
    assert "no valid CNI network configuration" in agent.prop("LastError")
