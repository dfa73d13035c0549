"""Errors, access, readiness signals, sd_notify, locking and shutdown of the real daemon."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.agent import NAME, Agent, Bus, options
from tests.support.plugins import Control, wait_for
from tests.support.state import record

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


# --- every error name, as gdbus shows it ---------------------------------------------


def test_not_ready_when_no_network_exists(make_agent: Callable[..., Agent], netns: str) -> None:
    agent = make_agent(timeouts={"ready": 0.3})
    assert agent.prop("NetworkReady") is False
    assert "no valid CNI network configuration" in agent.prop("LastError")
    out = agent.gdbus("Setup", "s1", netns, "{}")
    assert ERR + "NotReady" in out.stderr
    assert "network not ready after 0.3s" in out.stderr


def test_not_found(make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str) -> None:
    testnet()
    agent = make_agent()
    assert ERR + "NotFound" in agent.gdbus("Show", "nobody-here").stderr
    out = agent.gdbus("Setup", "s1", netns, "{'networks': <[('nosuchnet', 'eth0')]>}")
    assert ERR + "NotFound" in out.stderr and "valid networks: testnet" in out.stderr
    assert ERR + "NotFound" in agent.gdbus("Check", "s1", netns, "{}").stderr


def test_invalid_argument_for_bad_ids_and_paths(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet()
    agent = make_agent()
    regular = tmp_path / "file"
    regular.write_text("")
    cases = [("../etc", "/proc/self/ns/net", "sandbox_id: '../etc' must start with"),
             ("ok", str(regular), "is a regular file, not a namespace"),
             ("ok", str(tmp_path), "is a directory"),
             ("ok", "relative/path", "not an absolute path"),
             ("ok", "/proc/self/ns/mnt", "mnt namespace"),
             ("ok", "/run/netns/does-not-exist", "does not exist")]
    for sid, ns, words in cases:
        out = agent.gdbus("Setup", sid, ns, "{}")
        assert ERR + "InvalidArgument" in out.stderr, out.stderr
        assert words in out.stderr, out.stderr
    own = f"/proc/{agent.proc.pid}/ns/net" if agent.proc else ""
    out = agent.gdbus("Setup", "ok", own, "{}")
    assert "refusing to configure the agent's own network namespace" in out.stderr


def test_wrong_signature_is_invalid_argument(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    # gdbus checks signatures itself; dbus-send sends what it is told and shows the error name.
    for method, args, sig in (("Setup", ["string:only-one-arg"], "s"),
                              ("WaitReady", ["string:five"], "s"),
                              ("SetPodCIDRs", ["string:10.0.0.0/8"], "s"),
                              ("Show", ["int32:1"], "i")):
        out = subprocess.run(
            ["dbus-send", f"--bus={agent.bus.address}", "--print-reply", f"--dest={NAME}",
             "/org/cniagent/Agent1", f"org.cniagent.Agent1.{method}", *args],
            capture_output=True, text=True)
        assert ERR + "InvalidArgument" in out.stderr, out.stderr
        assert f"{method} takes arguments" in out.stderr and f"not ({sig})" in out.stderr


def test_busy_when_another_process_holds_the_sandbox_lock(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str, tmp_path: Path
) -> None:
    testnet()
    agent = make_agent(timeouts={"lock": 0.5})
    locks = tmp_path / "run" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(["flock", str(locks / "held.lock"), "sleep", "30"])
    try:
        wait_for(lambda: (locks / "held.lock").exists())
        time.sleep(0.1)
        out = agent.gdbus("Setup", "held", netns, "{}")
        assert ERR + "Busy" in out.stderr and "not acquired within 0.5s" in out.stderr
    finally:
        holder.kill()
        holder.wait()


def test_plugin_failed_and_timeout(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    testnet()
    agent = make_agent(timeouts={"add": 1})
    control.set("ADD", "fail", code=7, msg="bad subnet", details="10.0.0.0/33")
    out = agent.gdbus("Setup", "pf", netns, "{}")
    assert ERR + "PluginFailed" in out.stderr
    assert "plugin testplug ADD failed (code 7): bad subnet: 10.0.0.0/33" in out.stderr
    control.set("ADD", "hang")
    out = agent.gdbus("Setup", "to", netns, "{}")
    assert ERR + "Timeout" in out.stderr and "timed out after 1s" in out.stderr
    # Rolled back: the hung ADD got its DEL, nothing cached, agent still ready.
    assert [r["env"]["CNI_CONTAINERID"] for r in control.records() if r["command"] == "DEL"] \
        == ["pf", "to"]
    assert agent.call("ListSandboxes")[0] == []
    assert agent.prop("NetworkReady") is True


def test_log_lines_carry_the_journal_fields(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    """What `journalctl NETWORK=… PLUGIN=…` finds (on stderr the fields are shown
    as [K=V …]; under systemd the same record attributes become journal fields)."""
    testnet()
    agent = make_agent()
    agent.setup("jf", netns)
    agent.call("Teardown", "ssa{sv}", "jf", netns, "0")
    control.set("ADD", "fail", code=7, msg="bad subnet")
    agent.gdbus("Setup", "jf2", netns, "{}")
    lines = agent.log().splitlines()

    def having(text: str) -> list[str]:
        return [line for line in lines if text in line]

    sandbox = "SANDBOX_ID=jf NETWORK=testnet IFNAME=eth0"
    assert all(sandbox in line for line in having("sandbox jf ")), having("sandbox jf ")
    assert any(f"[{sandbox}]" in line for line in having("set up")), lines
    assert any(f"[{sandbox}]" in line for line in having("torn down")), lines
    # Every plugin execution: debug when it runs, warning when it fails.
    assert having(f"[{sandbox} CNI_COMMAND=ADD PLUGIN=testplug]")
    assert having(f"[{sandbox} CNI_COMMAND=DEL PLUGIN=testplug]")
    failed = having("WARNING ") and [line for line in having("WARNING ") if "ADD of testnet failed" in line]
    assert failed and all("[SANDBOX_ID=jf2 NETWORK=testnet IFNAME=eth0 CNI_COMMAND=ADD "
                          "PLUGIN=testplug]" in line for line in failed), lines
    # The STATUS poll names its plugin too, and its failures are not warnings.
    assert having("CNI_COMMAND=STATUS PLUGIN=testplug]")


# --- access -----------------------------------------------------------------------------


def test_nobody_reads_properties_but_cannot_set_up_on_the_system_policy(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str
) -> None:
    testnet()
    agent = make_agent()
    assert agent.prop("NetworkReady", user="nobody") is True
    assert agent.call("WaitReady", "d", "1", user="nobody")[0] is True
    # The policy lets the call through (for polkit's sake); the daemon refuses it.
    out = agent.gdbus("Setup", "x", netns, "{}", user="nobody")
    assert ERR + "AccessDenied" in out.stderr and "caller uid 65534" in out.stderr
    assert agent.call("ListSandboxes")[0] == []
    intro = agent.busctl("introspect", NAME, "/org/cniagent/Agent1", user="nobody")
    assert ".Setup" in intro.stdout


@pytest.fixture
def test_group() -> Iterator[str]:
    name = f"cnitest{os.getpid() % 100000}"
    subprocess.run(["groupadd", name], check=True)
    yield name
    subprocess.run(["groupdel", name], check=False)


def test_daemon_checks_access_itself_on_a_permissive_bus(
    make_agent: Callable[..., Agent], permissive_bus: Bus, testnet: Callable[..., Path],
    netns: str, test_group: str,
) -> None:
    testnet()
    agent = make_agent(bus=permissive_bus, access={"groups": [test_group]})
    assert agent.prop("NetworkReady", user="nobody") is True
    for method, args in (("Setup", ("x", netns, "{}")), ("Teardown", ("x", "", "{}")),
                         ("GarbageCollect", ("@as []",)), ("Reload", ()),
                         ("SetPodCIDRs", ("@as []",)), ("ListSandboxes", ())):
        out = agent.gdbus(method, *args, user="nobody")
        assert ERR + "AccessDenied" in out.stderr, (method, out.stderr)
    assert f"requires root or membership in the {test_group} group (caller uid 65534)" in out.stderr
    # A member of the configured group may call.
    member = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={test_group}",
         "gdbus", "call", "--address", permissive_bus.address, "--dest", NAME, "--object-path",
         "/org/cniagent/Agent1", "--method", "org.cniagent.Agent1.ListSandboxes"],
        capture_output=True, text=True)
    assert member.returncode == 0, member.stderr


# --- readiness on the bus and to systemd ---------------------------------------------------


def test_properties_changed_and_status_lines_follow_readiness(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path]
) -> None:
    conf = testnet()
    agent = make_agent()
    assert agent.notify is not None
    agent.notify.wait_for("READY=1")
    monitor = subprocess.Popen(
        ["gdbus", "monitor", "--address", agent.bus.address, "--dest", NAME],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        time.sleep(0.5)  # gdbus monitor subscribes
        conf.unlink()
        wait_for(lambda: agent.prop("NetworkReady") is False)
        agent.notify.wait_for("STATUS=Network not ready: no valid CNI network configuration")
        testnet()
        wait_for(lambda: agent.prop("NetworkReady") is True)
        agent.notify.wait_for("STATUS=Network ready: default network testnet (1 network)")
        time.sleep(0.3)
    finally:
        monitor.terminate()
        out = monitor.communicate()[0]
    assert "'NetworkReady': <false>" in out and "'NetworkReady': <true>" in out
    assert "PropertiesChanged" in out


def test_sighup_reload_and_stopping_and_watchdog(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet()
    agent = make_agent(start=False)
    agent.start(env={"WATCHDOG_USEC": "200000"})
    assert agent.notify is not None and agent.proc is not None
    agent.notify.wait_for("WATCHDOG=1")
    n = len(agent.notify.messages)
    agent.proc.send_signal(signal.SIGHUP)
    i = agent.notify.wait_for("RELOADING=1", after=n)
    assert any(line.startswith("MONOTONIC_USEC=") for line in agent.notify.messages[i].splitlines())
    agent.notify.wait_for("READY=1", after=i + 1)
    agent.call("Reload")
    assert agent.stop() == 0
    lines = agent.notify.lines()
    assert "STOPPING=1" in lines
    assert lines.index("STOPPING=1") > lines.index("READY=1")


# --- locking ---------------------------------------------------------------------------------


def _intervals(control: Control, sandbox: str) -> list[tuple[float, float, str]]:
    """The plugin runs of a sandbox; a scheduled CHECK killed because a request
    arrived (drift.py; killed before the lock is handed over) has no end and
    changes nothing: left out."""
    ends = {r["pid"]: r["end"] for r in control.records("end")}
    return sorted((r["start"], ends[r["pid"]], r["command"]) for r in control.records()
                  if r["env"]["CNI_CONTAINERID"] == sandbox
                  and (r["pid"] in ends or r["command"] != "CHECK"))


def test_racing_processes_never_overlap_on_one_sandbox(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    testnet()
    control.update(sleep=0.05)
    agent = make_agent()
    script = (
        "import subprocess, sys\n"
        "a, ns = sys.argv[1], sys.argv[2]\n"
        "base = ['busctl', '--address=' + a, 'call', 'org.cniagent.Agent1',"
        " '/org/cniagent/Agent1', 'org.cniagent.Agent1']\n"
        "for _ in range(8):\n"
        "    subprocess.run(base + ['Setup', 'ssa{sv}', 'race', ns, '0'], check=True)\n"
        "    subprocess.run(base + ['Teardown', 'ssa{sv}', 'race', ns, '0'], check=True)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, agent.bus.address, netns])
             for _ in range(2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    spans = _intervals(control, "race")
    assert len(spans) >= 2
    for (_, e1, c1), (s2, _, c2) in itertools.pairwise(spans):
        assert e1 <= s2, f"{c1} and {c2} overlapped"
    assert agent.call("ListSandboxes")[0] == []


def test_second_teardown_finds_nothing_to_do(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    testnet()
    control.update(sleep=0.2)
    agent = make_agent()
    agent.setup("twice", netns)
    procs = [agent.busctl_bg("Teardown", "ssa{sv}", "twice", netns, "0") for _ in range(2)]
    assert [p.wait(30) for p in procs] == [0, 0]
    assert [r["command"] for r in control.records()
            if r["env"]["CNI_CONTAINERID"] == "twice"].count("DEL") == 1


def test_a_del_queued_before_an_add_runs_first(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    testnet()
    control.set("ADD", "succeed", sleep=0.6)
    agent = make_agent()
    first = agent.busctl_bg("Setup", "ssa{sv}", "fair", netns, "0")
    wait_for(lambda: "ADD" in control.commands())
    teardown = agent.busctl_bg("Teardown", "ssa{sv}", "fair", netns, "0")
    time.sleep(0.2)
    second = agent.busctl_bg("Setup", "ssa{sv}", "fair", netns, *options(args={"late": "1"}))
    assert [p.wait(30) for p in (first, teardown, second)] == [0, 0, 0]
    # (then the baseline CHECK of the last Setup, drift.py)
    assert [c for _, _, c in _intervals(control, "fair") if c != "CHECK"] == ["ADD", "DEL", "ADD"]


# --- shutdown ----------------------------------------------------------------------------------


def test_sigterm_drains_and_finishes_in_flight_work(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent(shutdown_drain=1.0)
    early = netns_factory()
    agent.setup("early", early)
    control.set("ADD", "succeed", sleep=3.0)
    slow = [agent.busctl_bg("Setup", "ssa{sv}", f"slow{i}", netns_factory(), "0") for i in range(3)]
    wait_for(lambda: sum(1 for r in control.records() if r["command"] == "ADD") >= 4)
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    wait_for(lambda: agent.prop("NetworkReady") is False, timeout=0.5)
    assert agent.prop("LastError") == "shutting down"
    agent.call("Teardown", "ssa{sv}", "early", early, "0")  # served during the drain
    while time.monotonic() - t0 < 1.3:
        time.sleep(0.05)
    late = agent.gdbus("Setup", "late", netns_factory(), "{}")
    assert ERR + "ShuttingDown" in late.stderr
    outs = [p.communicate(timeout=30) for p in slow]
    assert [p.returncode for p in slow] == [0, 0, 0], outs
    assert agent.proc.wait(30) == 0
    assert agent.notify is not None and "STOPPING=1" in agent.notify.lines()


def test_an_idle_agent_stops_about_a_second_after_sigterm(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path],
) -> None:
    """Nothing in flight, nobody calling: the drain ends after 1 s of quiet, not
    after the whole shutdown_drain (before: every stop and restart took 10 s)."""
    testnet()
    agent = make_agent(shutdown_drain=10.0)
    assert agent.proc is not None and agent.notify is not None
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 10.0, elapsed  # well under the drain; not a tight timing
    assert "STOPPING=1" in agent.notify.lines()
    assert "the drain ends after" in agent.log()


def test_a_call_in_flight_keeps_the_drain_going_and_completes(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str],
) -> None:
    testnet()
    agent = make_agent(shutdown_drain=10.0)
    control.set("ADD", "succeed", sleep=2.5)
    slow = agent.busctl_bg("Setup", "ssa{sv}", "slow", netns_factory(), "0")
    wait_for(lambda: any(r["command"] == "ADD" for r in control.records()))
    assert agent.proc is not None and agent.notify is not None
    t0 = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    agent.notify.wait_for("STOPPING=1")
    time.sleep(1.5)  # longer than the quiet time: only the call in flight keeps us serving
    control.set("ADD", "succeed")
    late = agent.busctl("call", NAME, "/org/cniagent/Agent1", NAME, "Setup", "ssa{sv}", "late",
                        netns_factory(), "0", check=False)
    assert late.returncode == 0, late.stderr  # still served: the drain had not ended
    _, err = slow.communicate(timeout=30)
    assert slow.returncode == 0, err
    assert agent.proc.wait(30) == 0
    assert time.monotonic() - t0 < 10.0  # ended once idle, before shutdown_drain
    rec = record(agent.tmp / "state", "slow")
    assert rec is not None and [a["phase"] for a in rec["attachments"]] == ["ready"]


def test_the_bus_going_away_during_the_drain_ends_it(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    """A node shutdown stops dbus alongside the agent: no caller can reach us any
    more, so the drain ends, the Setup in flight still completes, exit 0."""
    bus = Bus("system")
    testnet()
    agent = make_agent(bus=bus, shutdown_drain=120.0)
    control.set("ADD", "succeed", sleep=2.0)
    inflight = agent.busctl_bg("Setup", "ssa{sv}", "inflight", netns, "0")
    wait_for(lambda: any(r["command"] == "ADD" for r in control.records()))
    assert agent.proc is not None and agent.notify is not None
    agent.proc.send_signal(signal.SIGTERM)
    agent.notify.wait_for("STOPPING=1")
    os.kill(bus.pid, signal.SIGKILL)
    inflight.communicate(timeout=30)
    # Well before the 120 s drain; with the old code the exit waited for it.
    assert agent.proc.wait(30) == 0
    log = agent.log()
    assert "the bus went away during the drain" in log
    assert "cni-agent stopped" in log
    # (dbus-fast itself logs that the reply to the Setup could not be sent.)
    assert "listener failed" not in log and "changed size during iteration" not in log
    # The Setup that was in flight finished: its record is complete.
    rec = record(tmp_path / "state", "inflight")
    assert rec is not None and [a["phase"] for a in rec["attachments"]] == ["ready"]
    bus.stop()


def test_bad_config_exits_2_naming_the_key(tmp_path: Path, system_bus: Bus) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"bus: '{system_bus.address}'\nmonitor:\n  intervall: 3\n")
    out = subprocess.run([sys.executable, "-m", "cni_agent", "run", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"{cfg}: monitor.intervall: unknown key" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    owner = subprocess.run(["busctl", f"--address={system_bus.address}", "status", NAME],
                           capture_output=True, text=True)
    assert owner.returncode != 0



def test_losing_the_bus_exits_non_zero_for_a_restart(
    make_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    bus = Bus("system")
    agent = make_agent(bus=bus)
    bus.stop()
    assert agent.proc is not None
    assert agent.proc.wait(30) == 1
    assert "lost the connection to the bus" in agent.log()


def test_plugins_run_in_the_root_directory(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, netns: str
) -> None:
    """The agent's cwd is whatever started it; the daemon moves to / so its plugins run there."""
    testnet()
    agent = make_agent()
    agent.setup("cwd", netns)
    agent.call("Teardown", "ssa{sv}", "cwd", netns, "0")
    assert {r["cwd"] for r in control.records()} == {"/"}
    # Nothing of the agent's (bus socket, inotify, locks, the pinned netns) leaks
    # into a plugin: it gets stdin, stdout and stderr only.
    assert [r["inherited_fds"] for r in control.records() if r["inherited_fds"]] == []
