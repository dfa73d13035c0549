"""The one plugin execution path, against our scripted plugin."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from cni_agent.cni.errors import (
    ExecError,
    PluginBadOutput,
    PluginError,
    PluginKilled,
    PluginNotExecutable,
    PluginNotFound,
    PluginTimeout,
    PluginUnsafe,
)
from cni_agent.cni.exec import Invocation, PluginLookups, ProcessExecutor, decode_json, find_plugin
from tests.support.plugins import Control, shell_plugin

ADD = Invocation("ADD", "c1", "/run/netns/x", "eth0", "A=1", "/usr/lib/cni")


def _stdin(control: Control, **extra: object) -> bytes:
    return json.dumps({"cniVersion": "1.0.0", "name": "n", "type": "testplug",
                       "control": str(control.path), **extra}).encode()


async def _run(plugin_dir: Path, control: Control, inv: Invocation = ADD,
               timeout: float = 10, **kw: object) -> bytes:
    binary = find_plugin("testplug", [str(plugin_dir)])
    return await ProcessExecutor(**kw).execute(  # type: ignore[arg-type]
        "testplug", binary, inv, _stdin(control), timeout
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is not running.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


async def test_success_passes_the_six_variables_and_stdin(plugin_dir: Path, control: Control) -> None:
    out = await _run(plugin_dir, control)
    result = decode_json("testplug", "ADD", out)
    assert result["ips"][0]["address"] == "10.123.0.2/24"
    rec = control.records()[0]
    assert rec["env"] == {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1",
                          "CNI_NETNS": "/run/netns/x", "CNI_IFNAME": "eth0",
                          "CNI_ARGS": "A=1", "CNI_PATH": "/usr/lib/cni"}
    assert rec["stdin"]["control"] == str(control.path)


async def test_agent_systemd_variables_do_not_reach_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "envbin"
    bindir.mkdir(mode=0o755)
    dump = tmp_path / "env.txt"
    script = bindir / "envdump"
    script.write_text(f"#!/bin/sh\nenv > {dump}\n")
    script.chmod(0o755)
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("CNI_AGENT_MARKER", "kept")
    await ProcessExecutor().execute("envdump", str(script), ADD, b"{}", 5)
    env = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert "NOTIFY_SOCKET" not in env
    assert env["CNI_AGENT_MARKER"] == "kept"
    assert env["CNI_COMMAND"] == "ADD" and env["CNI_ARGS"] == "A=1"


async def test_plugin_error_carries_code_msg_details(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "fail", code=11, msg="try later", details="lease busy")
    with pytest.raises(PluginError) as e:
        await _run(plugin_dir, control)
    assert (e.value.plugin, e.value.verb, e.value.code) == ("testplug", "ADD", 11)
    assert e.value.msg == "try later" and e.value.details == "lease busy"
    assert str(e.value) == "plugin testplug ADD failed (code 11): try later: lease busy"


async def test_timeout_kills_the_whole_process_group(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "spawn-hang")
    start = time.monotonic()
    with pytest.raises(PluginTimeout) as e:
        await _run(plugin_dir, control, timeout=1.0)
    # It ended by its 1 s timeout (the plugin hangs for ever): any finite bound
    # shows that; a generous one holds on a loaded machine.
    assert time.monotonic() - start < 10
    assert "timed out after 1s" in str(e.value)
    child = next(r["child"] for r in control.records(None) if "child" in r)
    # The forked child shared the group: it is gone too (no orphan left).
    deadline = time.monotonic() + 2
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


async def test_hang_ignoring_sigterm_is_killed(plugin_dir: Path, control: Control) -> None:
    control.set("DEL", "hang")
    with pytest.raises(PluginTimeout):
        await _run(plugin_dir, control, Invocation("DEL", "c1", "", "eth0", "", "/x"), timeout=0.5)
    pid = control.records()[0]["pid"]
    assert not _alive(pid)


async def test_crash_by_signal(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "crash", signal="SEGV")
    with pytest.raises(PluginKilled) as e:
        await _run(plugin_dir, control)
    assert "SIGSEGV" in str(e.value)


async def test_nonzero_exit_without_output(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "exit", exit=3)
    with pytest.raises(ExecError) as e:
        await _run(plugin_dir, control)
    assert "exited with status 3" in str(e.value)


async def test_garbage_is_a_bad_output_error(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "garbage")
    out = await _run(plugin_dir, control)
    with pytest.raises(PluginBadOutput) as e:
        decode_json("testplug", "ADD", out)
    assert "not JSON" in str(e.value)


async def test_huge_output_is_cut_off(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "huge", bytes=3_000_000)
    with pytest.raises(PluginBadOutput) as e:
        await _run(plugin_dir, control, max_stdout=1_000_000)
    assert "more than 1000000 bytes" in str(e.value)


async def test_not_executable(plugin_dir: Path, control: Control) -> None:
    os.chmod(plugin_dir / "testplug", 0o644)
    with pytest.raises(PluginNotExecutable) as e:
        await _run(plugin_dir, control)
    assert "Permission denied" in str(e.value)


async def test_vanished_between_lookup_and_exec(plugin_dir: Path, control: Control) -> None:
    binary = find_plugin("testplug", [str(plugin_dir)])
    os.unlink(binary)
    with pytest.raises(PluginNotFound) as e:
        await ProcessExecutor().execute("testplug", binary, ADD, _stdin(control), 5)
    assert "vanished" in str(e.value)


def test_lookup_order_and_missing(tmp_path: Path, plugin_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_plugin("testplug", [str(empty), str(plugin_dir)]) == str(plugin_dir / "testplug")
    with pytest.raises(PluginNotFound) as e:
        find_plugin("nosuch", [str(empty), str(plugin_dir)])
    assert str(empty) in str(e.value)
    with pytest.raises(PluginNotFound):
        find_plugin("../testplug", [str(plugin_dir)])


@pytest.mark.root
def test_world_writable_binary_or_dir_is_refused(plugin_dir: Path) -> None:
    os.chmod(plugin_dir / "testplug", 0o777)
    with pytest.raises(PluginUnsafe) as e:
        find_plugin("testplug", [str(plugin_dir)])
    assert "writable by non-root users" in str(e.value)
    os.chmod(plugin_dir / "testplug", 0o755)
    os.chmod(plugin_dir, 0o777)
    with pytest.raises(PluginUnsafe):
        find_plugin("testplug", [str(plugin_dir)])
    os.chmod(plugin_dir, 0o755)
    os.chown(plugin_dir / "testplug", 65534, 65534)
    with pytest.raises(PluginUnsafe) as e:
        find_plugin("testplug", [str(plugin_dir)])
    assert "owned by uid 65534" in str(e.value)


@pytest.mark.root
def test_a_remembered_lookup_sees_every_change_a_fresh_one_would(tmp_path: Path,
                                                                  plugin_dir: Path) -> None:
    """The executor remembers lookups; each change below is refused or found
    anew at once, as by `find_plugin`, with no file event or rescan."""
    lookups = PluginLookups()
    first = tmp_path / "first"
    first.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    dirs = [str(first), str(plugin_dir)]
    binary = plugin_dir / "testplug"
    assert lookups.find("testplug", dirs, "ADD") == str(binary)
    assert lookups.find("testplug", dirs, "ADD") == str(binary)  # remembered
    for change, undo in (
        (lambda: os.chmod(binary, 0o777), lambda: os.chmod(binary, 0o755)),  # the binary
        (lambda: os.chmod(plugin_dir, 0o777), lambda: os.chmod(plugin_dir, 0o755)),  # its dir
        (lambda: os.chown(plugin_dir.parent, 65534, 65534),  # a dir above it
         lambda: os.chown(plugin_dir.parent, 0, 0)),
    ):
        change()
        with pytest.raises(PluginUnsafe):
            lookups.find("testplug", dirs, "ADD")
        undo()
        assert lookups.find("testplug", dirs, "ADD") == str(binary)
    # Replaced by a symlink to a binary nobody but root may change: followed.
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (target / "testplug").write_bytes(binary.read_bytes())
    os.chmod(target / "testplug", 0o755)
    moved = tmp_path / "testplug.orig"
    os.rename(binary, moved)
    os.symlink(target / "testplug", binary)
    assert lookups.find("testplug", dirs, "ADD") == str(binary)
    os.chmod(target, 0o777)  # where the symlink leads
    with pytest.raises(PluginUnsafe):
        lookups.find("testplug", dirs, "ADD")
    os.chmod(target, 0o755)
    # The plugin put into a dir searched first: that one now.
    (first / "testplug").write_bytes(b"#!/bin/sh\n")
    os.chmod(first / "testplug", 0o755)
    assert lookups.find("testplug", dirs, "ADD") == str(first / "testplug")
    os.unlink(first / "testplug")
    os.unlink(binary)
    os.rename(moved, binary)
    assert lookups.find("testplug", dirs, "ADD") == str(binary)
    os.unlink(binary)  # gone
    with pytest.raises(PluginNotFound):
        lookups.find("testplug", dirs, "ADD")


async def test_stdin_larger_than_a_pipe_is_fed_whole(tmp_path: Path) -> None:
    """Most configs fit the pipe before the plugin starts; a larger one is fed as it reads."""
    binary = shell_plugin(tmp_path, "count", "wc -c\n")
    stdin = b"x" * (1024 * 1024 + 17)
    out = await ProcessExecutor().execute("count", binary, ADD, stdin, 10)
    assert int(out) == len(stdin)


async def test_plugin_that_never_reads_stdin(tmp_path: Path) -> None:
    binary = shell_plugin(tmp_path, "deaf", "echo '{}'\n")
    out = await ProcessExecutor().execute("deaf", binary, ADD, b"y" * (1024 * 1024), 10)
    assert out.strip() == b"{}"


async def test_plugins_run_in_the_agents_directory_with_default_sigpipe(tmp_path: Path) -> None:
    """posix_spawn: the cwd is inherited (the daemon's is /) and SIGPIPE, which
    Python ignores, is back to default, as Popen's restore_signals did."""
    binary = shell_plugin(tmp_path, "where", "pwd; grep SigIgn /proc/self/status\n")
    out = (await ProcessExecutor().execute("where", binary, ADD, b"{}", 10)).decode().split()
    assert out[0] == os.getcwd()
    assert not int(out[2], 16) & (1 << (13 - 1))  # SIGPIPE is signal 13


async def test_cancelled_execution_kills_the_group(plugin_dir: Path, control: Control) -> None:
    control.set("ADD", "spawn-hang")
    task = asyncio.ensure_future(_run(plugin_dir, control, timeout=30))
    for _ in range(250):  # until the plugin forked its child
        if any("child" in r for r in control.records(None)):
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    records = control.records(None)
    pids = [r["child"] for r in records if "child" in r] + [r["pid"] for r in records if "pid" in r]
    assert len(pids) >= 2
    for _ in range(100):
        if not any(_alive(pid) for pid in pids):
            break
        await asyncio.sleep(0.02)
    assert not any(_alive(pid) for pid in pids)


async def test_output_larger_than_a_pipe_is_read_whole(tmp_path: Path) -> None:
    """A plugin blocked writing more than a pipe holds never exits on its own:
    its pipes are watched once it runs longer than a fast plugin would."""
    binary = shell_plugin(tmp_path, "big", "head -c 3000000 /dev/zero | tr '\\0' x\n"
                                      "head -c 1500000 /dev/zero | tr '\\0' y >&2\n")
    executor = ProcessExecutor(max_stdout=4_000_000, max_stderr=2_000_000)
    child = await executor._spawn("big", binary, ADD, b"{}")
    await asyncio.wait_for(child.finished(), 10)
    assert child.stdout == b"x" * 3_000_000
    assert child.stderr == b"y" * 1_500_000
    assert await child.reap() == 0


async def test_a_plugin_is_done_when_it_exits_and_its_group_goes_with_it(tmp_path: Path) -> None:
    """The plugin exits but a child of it still holds stdout: what it printed is
    the result, the child's later output is not waited for, and the child is
    killed with the plugin's group (issue 36: it used to hold the call until it
    closed stdout)."""
    pidfile = tmp_path / "child.pid"
    binary = shell_plugin(tmp_path, "late", f"(sleep 30; echo late) &\necho $! > {pidfile}\n"
                                       "echo '{\"early\": true}'\nexit 0\n")
    out = await asyncio.wait_for(ProcessExecutor().execute("late", binary, ADD, b"{}", 60), 20)
    assert json.loads(out) == {"early": True}
    child = int(pidfile.read_text())
    for _ in range(250):  # SIGKILLed: it goes at once, the kernel only takes a moment
        if not _alive(child):
            break
        await asyncio.sleep(0.02)
    assert not _alive(child)


async def test_a_plugin_inherits_no_descriptor_beyond_stdin_stdout_and_stderr(
    plugin_dir: Path, control: Control,
) -> None:
    """Whatever the agent holds open, inheritable or not (a descriptor that came
    on a D-Bus message is, as received), a plugin gets 0-2 only."""
    r, w = os.pipe()
    os.set_inheritable(r, True)
    os.set_inheritable(w, True)
    try:
        await _run(plugin_dir, control)
    finally:
        os.close(r)
        os.close(w)
    assert control.records()[0]["inherited_fds"] == []
