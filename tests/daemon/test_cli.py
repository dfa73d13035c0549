"""The `cni-agent` client commands, as subprocesses, against a real agent on the private bus."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from cni_agent import __version__
from cni_agent.cli import client as client_module
from cni_agent.cli.client import AgentClient, AgentStatus, ClientError, SandboxResult, error_from_reply
from cni_agent.cli.commands import main
from cni_agent.cli.output import colour_enabled, format_attachments, format_change, format_status
from tests.daemon.conftest import plug
from tests.support.agent import PERMISSIVE, Agent, Bus, as_user_python
from tests.support.plugins import Control

pytestmark = pytest.mark.root
START_HINT = "start it with `systemctl start cni-agent`, or `cni-agent run` / `make run` for development"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DBUS_SYSTEM_BUS_ADDRESS", "NO_COLOR")}
    return {**env, **extra}


def cli(bus: Agent | Bus | str, *args: str, user: str | None = None,
        env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`cni-agent ARGS --bus ADDRESS` (bus=None-ish "" leaves --bus out)."""
    address = bus.bus.address if isinstance(bus, Agent) else bus.address if isinstance(bus, Bus) else bus
    tail = [*args, *(["--bus", address] if address else [])]
    # Another user may not reach this checkout's .venv: it runs a readable copy.
    cmd = [*as_user_python(user), *tail] if user else [sys.executable, "-m", "cni_agent", *tail]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env())
    assert "Traceback" not in out.stderr, out.stderr
    return out


def ok(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert out.stderr == "", out.stderr
    return out.stdout


def failed(out: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one stderr line of a failed command."""
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cni-agent: "), out.stderr
    return out.stderr


class Lines:
    """A subprocess's stdout lines, read by a thread, awaited with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))

    def next_matching(self, pred: Callable[[str], bool], timeout: float = 10) -> str:
        while True:
            try:
                line = self._q.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no matching line within {timeout}s; saw {self.seen}") from None
            self.seen.append(line)
            if pred(line):
                return line


# --- against a ready agent ---------------------------------------------------------


def test_status_wait_list_and_the_bus_option_in_both_places(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path]
) -> None:
    testnet()
    agent = make_agent(pod_cidrs=["10.244.1.0/24"])
    text = ok(cli(agent, "status"))
    assert text.splitlines() == [
        "Network:   ready",
        "Status:    Network ready: default network testnet (1 network)",
        "Default:   testnet",
        "Networks:  testnet",
        "Pod CIDRs: 10.244.1.0/24",
    ]
    assert "\033[" not in text  # not a terminal: no colour
    doc = json.loads(ok(cli(agent, "status", "--json")))
    assert doc == {"network_ready": True, "status": agent.prop("Status"), "default_network": "testnet",
                   "networks": ["testnet"], "last_error": "", "pod_cidrs": ["10.244.1.0/24"],
                   "pod_cidrs_source": "config"}
    # --bus before the command works the same as after it.
    before = subprocess.run([sys.executable, "-m", "cni_agent", "--bus", agent.bus.address, "status",
                             "--json"], capture_output=True, text=True, env=_env(), timeout=30)
    assert json.loads(ok(before)) == doc
    # ... and DBUS_SYSTEM_BUS_ADDRESS is the default bus.
    assert json.loads(ok(cli("", "status", "--json",
                             env=_env(DBUS_SYSTEM_BUS_ADDRESS=agent.bus.address)))) == doc
    assert ok(cli(agent, "wait", "--timeout", "0")) == ""
    assert ok(cli(agent, "wait")) == ""
    assert ok(cli(agent, "list")) == ""
    assert json.loads(ok(cli(agent, "list", "--json"))) == {"sandboxes": []}


def test_setup_show_check_list_teardown_in_both_output_modes(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet(plugins=[plug(control, capabilities={"mac": True})])
    testnet("second-network", filename="90-second.conflist")
    agent = make_agent()
    ns1, ns2 = netns_factory(), netns_factory()

    out = ok(cli(agent, "setup", "sbx-one", ns1, "--pod", "default/web/uid-1", "--arg", "FOO=bar",
                 "--capabilities", '{"mac": "02:00:00:00:00:42"}'))
    assert out == "testnet  eth0  10.123.0.2/24\n"
    [add] = [r for r in control.records() if r["command"] == "ADD"]
    args = add["env"]["CNI_ARGS"].split(";")
    assert {"IgnoreUnknown=1", "K8S_POD_NAMESPACE=default", "K8S_POD_NAME=web",
            "K8S_POD_UID=uid-1", "FOO=bar"} <= set(args)
    assert add["stdin"]["runtimeConfig"]["mac"] == "02:00:00:00:00:42"

    doc = json.loads(ok(cli(agent, "setup", "sbx-two", ns2, "--network", "testnet",
                            "--network", "second-network:eth9", "--json")))
    assert doc["sandbox"] == "sbx-two"
    assert [(a["network"], a["ifname"]) for a in doc["attachments"]] == \
        [("testnet", "eth0"), ("second-network", "eth9")]
    assert doc["attachments"][0]["result"]["ips"][0]["address"] == "10.123.0.2/24"
    # Human output: aligned columns, one line per attachment; show has the same shape.
    assert ok(cli(agent, "show", "sbx-two")).splitlines() == [
        "testnet         eth0  10.123.0.2/24",
        "second-network  eth9  10.123.0.2/24",
    ]
    shown = json.loads(ok(cli(agent, "show", "sbx-two", "--json")))
    for a in shown["attachments"]:  # Show adds each attachment's check state
        assert a.pop("check")["state"] in ("unchecked", "ok")
    assert shown == doc
    assert ok(cli(agent, "list")).splitlines() == ["sbx-one", "sbx-two"]
    assert json.loads(ok(cli(agent, "list", "--json"))) == {"sandboxes": ["sbx-one", "sbx-two"]}

    assert ok(cli(agent, "check", "sbx-one", ns1)) == ""
    assert ok(cli(agent, "teardown", "sbx-one", ns1)) == ""
    assert ok(cli(agent, "teardown", "sbx-two")) == ""  # NETNS is optional
    assert ok(cli(agent, "teardown", "never-set-up")) == ""
    assert ok(cli(agent, "list")) == ""
    err = failed(cli(agent, "show", "sbx-one"))
    assert err == "cni-agent: not found: sandbox sbx-one has no cached attachments\n"


def test_every_exit_status_from_a_real_agent(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    """0 success, 1 failed, 2 usage, 3 not ready / timed out, 4 denied (5: the next test)."""
    agent = make_agent(timeouts={"ready": 0.3})
    # Not ready: status says why (exit 0: it could ask), state, setup and wait exit 3.
    text = ok(cli(agent, "status"))
    assert text.startswith("Network:    not ready\n")
    assert "Last error: no valid CNI network configuration" in text
    assert json.loads(ok(cli(agent, "status", "--json")))["network_ready"] is False
    out = cli(agent, "state")
    assert (out.returncode, out.stdout, out.stderr) == (3, "not-ready\n", "")
    err = failed(cli(agent, "setup", "s1", netns), 3)
    assert err.startswith("cni-agent: network not ready after 0.3s: no valid CNI network configuration")
    err = failed(cli(agent, "wait", "--timeout", "0.3"), 3)
    assert err.startswith("cni-agent: timed out: network not ready after 0.3s: no valid CNI network")

    # wait really waits: it returns once a network appears.
    waiting = subprocess.Popen([sys.executable, "-m", "cni_agent", "wait", "--timeout", "20",
                                "--bus", agent.bus.address], env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.8)
    assert waiting.poll() is None, waiting.communicate()
    testnet()
    assert waiting.wait(timeout=15) == 0
    out = cli(agent, "state")
    assert (out.returncode, out.stdout, out.stderr) == (0, "ready\n", "")

    assert failed(cli(agent, "setup", "s1", netns, "--network", "nosuchnet")).startswith(
        "cni-agent: not found: network nosuchnet not found (valid networks: testnet)")
    # The agent's InvalidArgument is the caller's mistake: a usage error, 2.
    assert failed(cli(agent, "setup", "s1", "relative/path"), 2).startswith(
        "cni-agent: invalid argument: ")
    assert failed(cli(agent, "check", "never", netns)).startswith("cni-agent: not found: ")
    control.set("ADD", "fail", code=7, msg="bad subnet", details="10.0.0.0/33")
    assert failed(cli(agent, "setup", "pf", netns)) == (
        "cni-agent: plugin failed: plugin testplug ADD failed (code 7): bad subnet: 10.0.0.0/33\n")
    # The daemon refuses an unprivileged caller (4; no polkit here); reading is allowed.
    err = failed(cli(agent, "teardown", "s2", user="nobody"), 4)
    assert err.startswith("cni-agent: access denied: ") and "cni-agent group" in err
    err = failed(cli(agent, "setup", "s2", netns, user="nobody"), 4)
    assert err.startswith("cni-agent: access denied: ") and "cni-agent group" in err
    assert json.loads(ok(cli(agent, "status", "--json", user="nobody")))["network_ready"] is True
    out = cli(agent, "state", user="nobody")
    assert (out.returncode, out.stdout) == (0, "ready\n")


def test_agent_not_running_and_bus_unreachable_exit_5(system_bus: Bus, tmp_path: Path) -> None:
    # The session's bus, with no agent on it (agents of other tests are stopped by now).
    for args in (["status"], ["wait"], ["monitor"], ["list", "--json"], ["show", "x"],
                 ["teardown", "x"]):
        err = failed(cli(system_bus, *args), 5)
        assert err == (f"cni-agent: agent not running: nothing owns org.cniagent.Agent1 on the bus "
                       f"{system_bus.address}; {START_HINT}\n"), args
    out = cli(system_bus, "state")
    assert (out.returncode, out.stdout, out.stderr) == (5, "not-running\n", "")
    gone = f"unix:path={tmp_path}/no-such.sock"
    err = failed(cli(gone, "status"), 5)
    assert err == (f"cni-agent: agent not running: the bus {gone} is unreachable "
                   f"(No such file or directory); {START_HINT}\n")
    err = failed(cli("", "setup", "x", "/run/netns/x", env=_env(DBUS_SYSTEM_BUS_ADDRESS=gone)), 5)
    assert f"the system bus ({gone}) is unreachable" in err
    out = cli(gone, "state")
    assert (out.returncode, out.stdout) == (5, "not-running\n")


def test_state_says_stopping_while_the_agent_drains(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str,
) -> None:
    testnet()
    agent = make_agent(shutdown_drain=5.0)
    control.set("ADD", "succeed", sleep=3.0)
    slow = agent.busctl_bg("Setup", "ssa{sv}", "slow", netns, "0")  # keeps the drain going
    assert agent.proc is not None and agent.notify is not None
    agent.proc.send_signal(signal.SIGTERM)
    agent.notify.wait_for("STOPPING=1")
    out = cli(agent, "state")
    assert (out.returncode, out.stdout, out.stderr) == (3, "stopping\n", "")
    err = failed(cli(agent, "wait", "--timeout", "0"), 3)
    assert "not ready" in err
    slow.communicate(timeout=30)
    assert agent.proc.wait(30) == 0


# --- monitor -------------------------------------------------------------------------


def test_monitor_prints_each_flip_and_stops_quietly_on_ctrl_c(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    conf = testnet()
    agent = make_agent()
    procs = [subprocess.Popen([sys.executable, "-m", "cni_agent", "monitor", *extra, "--bus",
                               agent.bus.address], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for extra in ([], ["--json"])]
    human, machine = (Lines(p) for p in procs)
    try:
        def ready_line(want: bool) -> Callable[[str], bool]:
            word = "  ready  " if want else "  not ready  "
            return lambda line: word in line

        def ready_json(want: bool, running: bool = True) -> Callable[[str], bool]:
            return lambda line: (json.loads(line)["network_ready"], json.loads(line)["agent_running"]) \
                == (want, running)

        first = human.next_matching(lambda _: True)
        assert "  ready      Network ready: default network testnet" in first
        datetime.strptime(first[:19], "%Y-%m-%d %H:%M:%S")
        doc = json.loads(machine.next_matching(lambda _: True))
        assert doc["network_ready"] is True and doc["networks"] == ["testnet"]
        assert datetime.fromisoformat(doc["time"]).tzinfo is not None

        saved = tmp_path / "saved.conflist"
        shutil.move(conf, saved)
        line = human.next_matching(ready_line(False))
        assert "Network not ready: no valid CNI network configuration" in line
        doc = json.loads(machine.next_matching(ready_json(False)))
        assert doc["last_error"].startswith("no valid CNI network configuration")
        shutil.move(saved, conf)
        human.next_matching(ready_line(True))
        machine.next_matching(ready_json(True))

        # The agent leaving the bus is a change too; the monitor keeps running.
        agent.stop()
        assert "cni-agent stopped: org.cniagent.Agent1 left the bus" in \
            human.next_matching(lambda line: "left the bus" in line)
        doc = json.loads(machine.next_matching(ready_json(False, running=False)))
        assert doc["last_error"] == "agent not running"
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
    for p in procs:
        assert p.wait(timeout=10) == 0
        assert p.stderr is not None and p.stderr.read() == ""


# --- usage, help, version (in-process: no agent needed) -------------------------------


@pytest.mark.parametrize("argv", [
    ["setup", "s1", "/run/netns/x", "--network", ":eth0"],
    ["setup", "s1", "/run/netns/x", "--network", "net:"],
    ["setup", "s1", "/run/netns/x", "--network", "net:eth0:x"],
    ["setup", "s1", "/run/netns/x", "--arg", "NOEQUALS"],
    ["setup", "s1", "/run/netns/x", "--arg", "=v"],
    ["setup", "s1", "/run/netns/x", "--arg", "K=1", "--arg", "K=2"],
    ["setup", "s1", "/run/netns/x", "--pod", "only-a-name"],
    ["setup", "s1", "/run/netns/x", "--pod", "ns//uid"],
    ["setup", "s1", "/run/netns/x", "--pod", "a/b/c/d"],
    ["setup", "s1", "/run/netns/x", "--capabilities", "[1, 2]"],
    ["setup", "s1", "/run/netns/x", "--capabilities", "{not json"],
    ["setup", "s1"],
    ["teardown"],
    ["wait", "--timeout", "-1"],
    ["wait", "--timeout", "soon"],
    ["status", "--bus", "not-an-address"],
    ["--bus", "", "status"],
    ["list", "extra"],
    ["frobnicate"],
    [],
])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code  # type: ignore[assignment]
    assert code == 2
    assert "usage: cni-agent" in capsys.readouterr().err


def test_usage_error_as_a_subprocess() -> None:
    out = cli("", "setup", "s1", "/run/netns/x", "--pod", "nope")
    assert out.returncode == 2
    assert "argument --pod: 'nope' is not NAMESPACE/NAME or NAMESPACE/NAME/UID" in out.stderr


@pytest.mark.parametrize("command", ["status", "wait", "monitor", "setup", "teardown", "detach",
                                     "check", "show", "list"])
def test_help_reads_like_a_synopsis(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: cni-agent {command} [-h] [--bus BUS]")
    assert "(default: system)" in text
    assert f"example:\n  $ cni-agent {command}" in text


def test_top_level_help_and_version() -> None:
    text = ok(cli("", "--help"))
    assert text.startswith("usage: cni-agent [-h] [--version] [--bus BUS] COMMAND ...")
    for command in ("run", "status", "wait", "monitor", "setup", "teardown", "detach", "check", "show",
                    "list"):
        assert f"\n    {command} " in text
    assert "exit status: 0 success" in text and "NO_COLOR" in text
    assert ok(cli("", "--version")) == f"cni-agent {__version__}\n"


# --- formatting and error mapping (pure functions) ------------------------------------


def test_colour_only_on_a_terminal_and_never_with_no_color() -> None:
    assert colour_enabled(True, {}) is True
    assert colour_enabled(True, {"NO_COLOR": ""}) is True  # only a non-empty value counts
    assert colour_enabled(True, {"NO_COLOR": "1"}) is False
    assert colour_enabled(False, {}) is False
    ready = AgentStatus(True, "Network ready: default network n (1 network)", "n", ("n",))
    down = AgentStatus(False, "Network not ready: gone", last_error="gone")
    assert "Network:   \033[32mready\033[0m\n" in format_status(ready, colour=True)
    assert "Network:    \033[31mnot ready\033[0m\n" in format_status(down, colour=True)
    assert "\033[" not in format_status(down, colour=False)
    when = datetime(2026, 5, 9, 7, 35, 25).astimezone()
    assert format_change(ready, when, colour=True) == \
        f"2026-05-09 07:35:25  \033[32mready    \033[0m  {ready.status}"
    assert format_change(down, when, colour=False) == "2026-05-09 07:35:25  not ready  " + down.status


def test_addresses_of_every_result_version() -> None:
    doc = {"sandbox": "s", "attachments": [
        {"network": "new", "ifname": "eth0", "result": {"ips": [{"address": "10.1.0.2/24"},
                                                                  {"address": "fd00::2/64"}]}},
        {"network": "legacy", "ifname": "net1", "result": {"ip4": {"ip": "10.2.0.2/24"}}},
        {"network": "bare", "ifname": "net2", "result": {}}]}
    assert format_attachments(SandboxResult.parse(json.dumps(doc))).splitlines() == [
        "new     eth0  10.1.0.2/24, fd00::2/64",
        "legacy  net1  10.2.0.2/24",
        "bare    net2  -",
    ]
    with pytest.raises(ClientError, match="not the documented JSON"):
        SandboxResult.parse('{"sandbox": "s"}')


@pytest.mark.parametrize(("name", "meaning"), [
    ("InvalidArgument", "invalid argument"), ("NotReady", "network not ready"),
    ("NotFound", "not found"), ("Busy", "busy"), ("PluginFailed", "plugin failed"),
    ("Timeout", "timed out"), ("AccessDenied", "access denied"),
    ("ShuttingDown", "agent shutting down"),
])
def test_every_agent_error_has_a_meaning(name: str, meaning: str) -> None:
    e = error_from_reply(f"org.cniagent.Agent1.Error.{name}", "the message\nand more", "system")
    assert str(e) == f"{meaning}: the message and more"
    assert e.name == f"org.cniagent.Agent1.Error.{name}"


def test_bus_errors_and_no_stutter() -> None:
    denied = error_from_reply("org.freedesktop.DBus.Error.AccessDenied", "Rejected send", "system")
    assert str(denied).startswith(
        "access denied: Rejected send (refused by the D-Bus daemon's policy, before cni-agent saw")
    gone = error_from_reply("org.freedesktop.DBus.Error.ServiceUnknown", "whatever", "session")
    assert str(gone) == \
        f"agent not running: nothing owns org.cniagent.Agent1 on the session bus; {START_HINT}"
    odd = error_from_reply("org.example.Error.Strange", "hm", "system")
    assert str(odd) == "org.example.Error.Strange: hm"
    assert str(ClientError("network not ready", "network not ready after 2s: x")) == \
        "network not ready after 2s: x"


async def test_wait_ready_waits_longer_than_one_call(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "WAIT_CHUNK", 0.2)
    agent = make_agent()
    async with await AgentClient.connect(agent.bus.address) as c:
        assert await c.wait_ready(0.5) is False
        waiting = asyncio.create_task(c.wait_ready(15))
        await asyncio.sleep(0.7)  # several WaitReady calls of 0.2s
        assert not waiting.done()
        testnet()
        assert await asyncio.wait_for(waiting, 10) is True
        assert (await c.status()).network_ready is True


def test_state_does_not_start_a_stopped_agent_through_bus_activation(tmp_path: Path) -> None:
    """On a node the bus starts cni-agent.service for any call to its name; a
    query of the state must report "not-running", not start it to answer."""
    marker = tmp_path / "activated"
    services = tmp_path / "services"
    services.mkdir()
    # A stand-in for systemd's start: it leaves a mark and fails, as the real file's
    # Exec=/bin/false does on a bus without systemd.
    (services / "org.cniagent.Agent1.service").write_text(
        f'[D-BUS Service]\nName=org.cniagent.Agent1\nExec=/bin/sh -c "touch {marker}; exit 1"\n')
    conf = tmp_path / "bus.conf"
    conf.write_text(PERMISSIVE.replace("@SOCKET@", str(tmp_path / "bus.sock")).replace(
        "<auth>EXTERNAL</auth>", f"<auth>EXTERNAL</auth>\n  <servicedir>{services}</servicedir>"))
    daemon = subprocess.run(["dbus-daemon", f"--config-file={conf}", "--print-address=1",
                             "--print-pid=1", "--fork"], capture_output=True, text=True, check=True)
    address, pid = daemon.stdout.split()[:2]
    try:
        out = cli(address, "state")
        assert (out.returncode, out.stdout, out.stderr) == (5, "not-running\n", "")
        assert not marker.exists()
        err = failed(cli(address, "status"), 5)  # status may start it (here: a stand-in that exits)
        assert "agent not running" in err
        assert marker.exists()
    finally:
        os.kill(int(pid), signal.SIGTERM)
