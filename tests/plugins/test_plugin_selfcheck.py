"""Self-check of tests/plugins/cni-test-plugin: run it directly and check each behaviour."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

PLUGIN = Path(__file__).resolve().parent / "cni-test-plugin"

FULL_ENV = {
    "CNI_CONTAINERID": "ctr-1",
    "CNI_NETNS": "/run/netns/test-ns",
    "CNI_IFNAME": "eth0",
    "CNI_ARGS": "K8S_POD_NAME=p;IgnoreUnknown=1",
    "CNI_PATH": "/opt/cni/bin",
}


def base_env(command: str, **overrides: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CNI_")}
    env.update(FULL_ENV, CNI_COMMAND=command)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class Plugin:
    """Runs the plugin with a control file under tmp_path."""

    def __init__(self, tmp_path: Path) -> None:
        self.control = tmp_path / "control.json"
        self.record = tmp_path / "record.jsonl"

    def set(self, **control: Any) -> None:
        control.setdefault("record", str(self.record))
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps(control))
        tmp.replace(self.control)

    def conf(self, version: str = "1.1.0", **extra: Any) -> dict[str, Any]:
        return {
            "cniVersion": version,
            "name": "testnet",
            "type": "cni-test-plugin",
            "control": str(self.control),
            **extra,
        }

    def run(
        self,
        command: str,
        stdin: Any = None,
        env: dict[str, str] | None = None,
        timeout: float = 5,
    ) -> subprocess.CompletedProcess[bytes]:
        data = stdin if isinstance(stdin, bytes) else json.dumps(stdin or self.conf()).encode()
        return subprocess.run(
            [str(PLUGIN)],
            input=data,
            env=env or base_env(command),
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def records(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def wait_record(self, phase: str, timeout: float = 3) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.records():
                if rec["phase"] == phase:
                    return rec
            time.sleep(0.01)
        raise AssertionError(f"no {phase!r} record")


@pytest.fixture
def plugin(tmp_path: Path) -> Plugin:
    return Plugin(tmp_path)


def out_json(proc: subprocess.CompletedProcess[bytes]) -> Any:
    return json.loads(proc.stdout)


def assert_error(proc: subprocess.CompletedProcess[bytes], code: int) -> dict[str, Any]:
    assert proc.returncode == 1, proc
    err = out_json(proc)
    assert set(err) == {"cniVersion", "code", "msg", "details"}
    assert err["code"] == code
    return err


def test_file_is_executable_with_fast_shebang() -> None:
    assert PLUGIN.stat().st_mode & 0o777 == 0o755
    assert stat.S_ISREG(PLUGIN.stat().st_mode)
    assert PLUGIN.read_text().splitlines()[0] == "#!/usr/bin/python3 -IS"


# --- succeed -----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0"])
def test_add_result_old_family(plugin: Plugin, version: str) -> None:
    proc = plugin.run("ADD", plugin.conf(version))
    assert proc.returncode == 0
    assert out_json(proc) == {
        "cniVersion": version,
        "ip4": {"ip": "10.123.0.2/24", "gateway": "10.123.0.1"},
    }


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
def test_add_result_new_families(plugin: Plugin, version: str) -> None:
    plugin.set(ADD={"action": "succeed", "ip": "192.168.7.9/16"})
    res = out_json(plugin.run("ADD", plugin.conf(version)))
    assert res["cniVersion"] == version
    assert res["interfaces"] == [
        {"name": "eth0", "sandbox": "/run/netns/test-ns"}
    ]
    ip = {"interface": 0, "address": "192.168.7.9/16", "gateway": "192.168.0.1"}
    if version < "1":
        ip["version"] = "4"
    assert res["ips"] == [ip]


def test_add_ipv6_old_family(plugin: Plugin) -> None:
    plugin.set(ADD={"ip": "fd00::5/64"})
    res = out_json(plugin.run("ADD", plugin.conf("0.2.0")))
    assert res["ip6"] == {"ip": "fd00::5/64", "gateway": "fd00::1"}


@pytest.mark.parametrize("version", ["0.4.0", "1.1.0"])
def test_add_passes_prev_result_and_appends_interface(plugin: Plugin, version: str) -> None:
    prev = {
        "cniVersion": version,
        "interfaces": [{"name": "cni0", "mac": "aa:bb:cc:dd:ee:ff"}],
        "ips": [{"interface": 0, "address": "10.9.0.3/24"}],
        "dns": {"nameservers": ["10.9.0.1"]},
    }
    res = out_json(plugin.run("ADD", plugin.conf(version, prevResult=prev)))
    assert res == {
        **prev,
        "interfaces": [*prev["interfaces"], {"name": "eth0-1", "sandbox": "/run/netns/test-ns"}],
    }


def test_add_prev_result_old_family_unchanged(plugin: Plugin) -> None:
    prev = {"cniVersion": "0.2.0", "ip4": {"ip": "10.9.0.3/24"}}
    assert out_json(plugin.run("ADD", plugin.conf("0.2.0", prevResult=prev))) == prev


@pytest.mark.parametrize("command", ["DEL", "CHECK", "STATUS", "GC"])
def test_other_verbs_succeed_silently(plugin: Plugin, command: str) -> None:
    proc = plugin.run(command)
    assert (proc.returncode, proc.stdout) == (0, b"")


def test_no_control_key_and_missing_control_file_succeed(plugin: Plugin) -> None:
    conf = plugin.conf()
    del conf["control"]
    assert plugin.run("ADD", conf).returncode == 0
    assert not plugin.control.exists()
    assert plugin.run("ADD").returncode == 0  # control key points at a missing file


def test_version_default_and_custom(plugin: Plugin) -> None:
    res = out_json(plugin.run("VERSION", b"", env={"CNI_COMMAND": "VERSION"}))
    assert res["cniVersion"] == "1.1.0"
    assert res["supportedVersions"] == "0.1.0 0.2.0 0.3.0 0.3.1 0.4.0 1.0.0 1.1.0".split()
    plugin.set(versions=["0.4.0", "1.0.0"])
    res = out_json(plugin.run("VERSION", {"cniVersion": "1.0.0", "control": str(plugin.control)}))
    assert res == {"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0"]}


def test_config_version_must_be_supported(plugin: Plugin) -> None:
    plugin.set(versions=["0.4.0", "1.0.0"])
    err = assert_error(plugin.run("ADD", plugin.conf("1.1.0")), 1)
    assert err["cniVersion"] == "1.1.0"
    assert plugin.run("ADD", plugin.conf("1.0.0")).returncode == 0


@pytest.mark.parametrize(
    ("command", "version"), [("CHECK", "0.3.1"), ("STATUS", "1.0.0"), ("GC", "1.0.0")]
)
def test_verb_not_allowed_for_old_config(plugin: Plugin, command: str, version: str) -> None:
    assert_error(plugin.run(command, plugin.conf(version)), 1)


# --- environment and stdin validation ------------------------------------------------


@pytest.mark.parametrize(
    ("command", "missing", "ok"),
    [
        ("ADD", "CNI_NETNS", False),
        ("ADD", "CNI_IFNAME", False),
        ("CHECK", "CNI_CONTAINERID", False),
        ("CHECK", "CNI_PATH", False),
        ("DEL", "CNI_NETNS", True),
        ("DEL", "CNI_IFNAME", False),
        ("STATUS", "CNI_CONTAINERID", True),
        ("STATUS", "CNI_PATH", False),
        ("GC", "CNI_IFNAME", True),
        ("GC", "CNI_PATH", False),
    ],
)
def test_env_validation(plugin: Plugin, command: str, missing: str, ok: bool) -> None:
    for value in (None, ""):  # unset and empty both count as missing
        proc = plugin.run(command, env=base_env(command, **{missing: value}))
        if ok:
            assert proc.returncode == 0, proc
        else:
            assert missing in assert_error(proc, 4)["msg"]


def test_version_needs_no_env(plugin: Plugin) -> None:
    proc = plugin.run("VERSION", {"cniVersion": "1.1.0"}, env={"CNI_COMMAND": "VERSION"})
    assert proc.returncode == 0


@pytest.mark.parametrize("command", ["BOGUS", "", None])
def test_unknown_command(plugin: Plugin, command: str | None) -> None:
    assert_error(plugin.run("ADD", env=base_env("ADD", CNI_COMMAND=command)), 4)


@pytest.mark.parametrize("stdin", [b"{not json", b"", b"[1, 2]"])
def test_invalid_stdin(plugin: Plugin, stdin: bytes) -> None:
    assert_error(plugin.run("ADD", stdin), 6)


# --- injected behaviours ----------------------------------------------------------------


def test_fail_with_code_msg_details(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "fail", "code": 11, "msg": "try later", "details": "busy"})
    err = assert_error(plugin.run("ADD", plugin.conf("1.0.0")), 11)
    assert err == {"cniVersion": "1.0.0", "code": 11, "msg": "try later", "details": "busy"}


def test_fail_default_code_and_default_key(plugin: Plugin) -> None:
    plugin.set(default={"action": "fail"}, DEL="succeed")
    for command in ("ADD", "CHECK", "STATUS", "GC", "VERSION"):
        assert assert_error(plugin.run(command), 999)["msg"]
    assert plugin.run("DEL").returncode == 0


def test_status_codes_50_51(plugin: Plugin) -> None:
    plugin.set(STATUS={"action": "fail", "code": 50, "msg": "not ready"})
    assert assert_error(plugin.run("STATUS"), 50)["msg"] == "not ready"


def test_exit_prints_nothing(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "exit"}, DEL={"action": "exit", "exit": 42})
    assert (plugin.run("ADD").returncode, plugin.run("ADD").stdout) == (3, b"")
    proc = plugin.run("DEL")
    assert (proc.returncode, proc.stdout, proc.stderr) == (42, b"", b"")


def test_garbage(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "garbage"})
    proc = plugin.run("ADD")
    assert proc.returncode == 0 and proc.stdout.strip()
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)


def test_huge(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "huge", "bytes": 5 * 1024 * 1024 + 7})
    proc = plugin.run("ADD")
    assert proc.returncode == 0
    assert len(proc.stdout) == 5 * 1024 * 1024 + 7
    assert proc.stdout.count(b"x") == len(proc.stdout)


def test_huge_reader_closes_early(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "huge", "bytes": 4 * 1024 * 1024})
    p = subprocess.Popen(
        [str(PLUGIN)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=base_env("ADD"),
    )
    assert p.stdin and p.stdout and p.stderr
    p.stdin.write(json.dumps(plugin.conf()).encode())
    p.stdin.close()
    assert p.stdout.read(1000) == b"x" * 1000
    p.stdout.close()
    assert p.wait(timeout=5) == 0
    assert b"Traceback" not in p.stderr.read()


@pytest.mark.parametrize(
    ("sig", "expected"),
    [(None, signal.SIGSEGV), ("USR1", signal.SIGUSR1), ("SIGKILL", signal.SIGKILL)],
)
def test_crash(plugin: Plugin, sig: str | None, expected: int) -> None:
    action: dict[str, Any] = {"action": "crash"}
    if sig:
        action["signal"] = sig
    plugin.set(CHECK=action)
    proc = plugin.run("CHECK")
    assert proc.returncode == -expected
    assert proc.stdout == b""
    assert [r["phase"] for r in plugin.records()] == ["start", "end"]
    assert plugin.records()[1]["signal"] == expected


def test_once_is_per_verb(plugin: Plugin) -> None:
    plugin.set(
        ADD={"action": "fail", "code": 11, "once": True}, DEL={"action": "exit", "once": True}
    )
    assert_error(plugin.run("ADD"), 11)
    assert plugin.run("ADD").returncode == 0
    assert plugin.run("ADD").returncode == 0
    assert plugin.run("DEL").returncode == 3
    assert plugin.run("DEL").returncode == 0
    assert Path(f"{plugin.control}.count.ADD").read_text() == "3"


def test_control_reread_every_invocation(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "fail", "code": 5})
    assert_error(plugin.run("ADD"), 5)
    plugin.set(ADD={"action": "succeed"})
    assert plugin.run("ADD").returncode == 0
    plugin.control.unlink()
    assert plugin.run("ADD").returncode == 0


def test_bad_control_file_and_unknown_action(plugin: Plugin) -> None:
    plugin.control.write_text("{broken")
    assert_error(plugin.run("ADD"), 999)
    plugin.set(ADD={"action": "explode"})
    assert "explode" in assert_error(plugin.run("ADD"), 999)["msg"]


def test_sleeps(plugin: Plugin) -> None:
    plugin.set(sleep=0.15, ADD={"action": "succeed", "sleep": 0.15})
    t0 = time.monotonic()
    assert plugin.run("ADD").returncode == 0
    assert time.monotonic() - t0 >= 0.3
    start, end = plugin.records()
    assert end["end"] - start["start"] >= 0.3


# --- recording ----------------------------------------------------------------------


def test_record_fields(plugin: Plugin) -> None:
    plugin.set()
    conf = plugin.conf(runtimeConfig={"portMappings": []})
    proc = plugin.run("ADD", conf)
    assert proc.returncode == 0
    start, end = plugin.records()
    assert (start["phase"], end["phase"]) == ("start", "end")
    for rec in (start, end):
        assert rec["command"] == "ADD"
        assert rec["type"] == "cni-test-plugin"
        assert rec["stdin"] == conf
        assert rec["env"] == {**FULL_ENV, "CNI_COMMAND": "ADD"}
        assert rec["start"] == start["start"]
    assert start["pid"] == end["pid"]
    assert start["end"] is None
    assert end["start"] <= end["end"] <= time.time()
    assert end["exit"] == 0


def test_record_env_unset_is_null(plugin: Plugin) -> None:
    plugin.set()
    plugin.run("DEL", env=base_env("DEL", CNI_NETNS=None))
    assert plugin.records()[0]["env"]["CNI_NETNS"] is None


def test_record_concurrent_lines_never_interleave(plugin: Plugin) -> None:
    plugin.set(sleep=0.2)
    conf = plugin.conf(padding="p" * 200_000)  # big lines: a torn write would show
    n = 8
    with ThreadPoolExecutor(n) as pool:
        procs = list(pool.map(lambda _: plugin.run("ADD", conf), range(n)))
    assert all(p.returncode == 0 for p in procs)
    recs = plugin.records()  # every line parses
    assert len(recs) == 2 * n
    starts = {r["pid"]: r["start"] for r in recs if r["phase"] == "start"}
    ends = {r["pid"]: r["end"] for r in recs if r["phase"] == "end"}
    assert len(starts) == len(ends) == n
    # the invocations overlapped, and the records show it
    assert max(starts.values()) < min(ends.values())


# --- hang / spawn-hang --------------------------------------------------------------------


def start_detached(plugin: Plugin, command: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        [str(PLUGIN)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=base_env(command),
        start_new_session=True,
    )
    assert p.stdin
    p.stdin.write(json.dumps(plugin.conf()).encode())
    p.stdin.close()
    return p


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_sigterm_ignored(pid: int, timeout: float = 3) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, mask = line.partition(":")
            if key == "SigIgn" and int(mask, 16) & (1 << (signal.SIGTERM - 1)):
                return
        time.sleep(0.01)
    raise AssertionError("SIGTERM never ignored")


def test_hang_ignores_sigterm_until_killed(plugin: Plugin) -> None:
    plugin.set(GC={"action": "hang"})
    p = start_detached(plugin, "GC")
    try:
        wait_sigterm_ignored(p.pid)  # it reached the action
        p.terminate()
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.2)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=2) == -signal.SIGKILL
    assert [r["phase"] for r in plugin.records()] == ["start"]


def test_spawn_hang_child_dies_with_process_group(plugin: Plugin) -> None:
    plugin.set(ADD={"action": "spawn-hang"})
    p = start_detached(plugin, "ADD")
    try:
        child = plugin.wait_record("spawned")["child"]
        assert alive(child) and alive(p.pid)
        assert os.getpgid(child) == p.pid  # same process group as the plugin
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=2) == -signal.SIGKILL
    assert p.stdout
    assert p.stdout.read() == b""  # EOF: the child (holding stdout) is gone too
    deadline = time.monotonic() + 2
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(child)
