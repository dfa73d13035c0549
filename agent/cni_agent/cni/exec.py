"""Running plugin binaries: the one code path every verb goes through.

libcni's seam in three parts: find a binary, execute it, decode its output.
The runtime takes an `Executor`, so tests can swap in a recorder while
production always forks through `ProcessExecutor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
from cni_agent.cni.leftovers import RUN_ENV, Leftovers
from cni_agent.cni.spawn import Child
from cni_agent.cni.trust import checked, identity

# The agent's own systemd plumbing must not leak into plugins: a plugin that
# inherited NOTIFY_SOCKET could speak to systemd on our behalf.
# Nor a trace context the agent was started with: a plugin's is its call's
# (`Invocation.trace`), or none.
_STRIPPED_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                 "LISTEN_PID", "LISTEN_FDNAMES", "INVOCATION_ID",
                 "TRACEPARENT", "TRACESTATE", "BAGGAGE")

_RUN_KEY = RUN_ENV.encode()
# os.fsencode's codec, for str.encode called directly (no Python frame per variable).
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()

MAX_STDOUT = 8 * 1024 * 1024
MAX_STDERR = 64 * 1024


@dataclass(frozen=True)
class Invocation:
    """The six CNI_* variables of one plugin execution, and its call's W3C
    trace context (TRACEPARENT, TRACESTATE, BAGGAGE: only those present;
    `tracectx`)."""

    command: str
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: str = ""
    path: str = ""
    trace: tuple[tuple[str, str], ...] = ()

    def environ(self) -> dict[str, str]:
        env = {
            "CNI_COMMAND": self.command,
            "CNI_CONTAINERID": self.container_id,
            "CNI_NETNS": self.netns,
            "CNI_IFNAME": self.ifname,
            "CNI_ARGS": self.args,
            "CNI_PATH": self.path,
        }
        if self.trace:
            env.update(self.trace)
        return env


class Executor(Protocol):
    """libcni's seam: find a plugin's binary, run it (its stdout on success)."""

    def find(self, plugin: str, dirs: Sequence[str], verb: str) -> str: ...

    async def execute(
        self, plugin: str, binary: str, inv: Invocation, stdin: bytes, timeout: float
    ) -> bytes: ...


def find_plugin(plugin: str, dirs: Iterable[str], verb: str = "lookup") -> str:
    """The binary for a plugin type: `<dir>/<type>` in the first dir holding it.

    Refuses a binary that a non-root user could replace (it, or any directory
    on the way to it: `trust.untrusted_reason`), because the agent runs it as
    root. Checked on every lookup (`PluginLookups` re-checks a remembered one).
    """
    return _find(plugin, dirs, verb)[0]


@dataclass(frozen=True)
class _Proof:
    """What a lookup rests on: the entries the trust verdict walked, each with
    its `identity` (lstat), and the paths in the dirs searched before the one
    that had the plugin (stat: no regular file there)."""

    walked: tuple[tuple[str, tuple[int, ...]], ...]
    before: tuple[str, ...]

    def holds(self) -> bool:
        try:
            for path, ident in self.walked:
                if identity(os.lstat(path)) != ident:
                    return False
        except OSError:
            return False
        for path in self.before:  # usually none: the plugin is in the first dir
            try:
                if stat.S_ISREG(os.stat(path).st_mode):
                    return False  # a plugin appeared in a dir searched first
            except OSError:
                pass
        return True


def _find(plugin: str, dirs: Iterable[str], verb: str) -> tuple[str, _Proof | None]:
    if not plugin or "/" in plugin or plugin in (".", ".."):
        raise PluginNotFound(plugin, verb, f"invalid plugin type {plugin!r}")
    searched = []
    for d in dirs:
        path = os.path.join(d, plugin)
        searched.append(d)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        try:
            reason, walked = checked(path)
        except OSError:
            continue  # vanished meanwhile
        if reason:
            raise PluginUnsafe(plugin, verb, f"refusing to run {path}: {reason}")
        if not walked:  # not root: nothing was judged, nothing to re-check
            return path, None
        return path, _Proof(tuple((entry, identity(est)) for entry, est in walked),
                            tuple(os.path.join(b, plugin) for b in searched[:-1]))
    where = ", ".join(searched) or "(no plugin directories configured)"
    raise PluginNotFound(plugin, verb, f"no binary {plugin!r} in {where}")


class PluginLookups:
    """`find_plugin`, remembered: an answer is given again while every entry it
    was decided from is as it was (one lstat or stat each, ~1 us, where the
    lookup walks and judges them again: ~20 us). The same verdict, always:
    a binary replaced, chmod'ed or chown'ed, a directory on the way to it
    changed, a symlink re-pointed (a new inode), or the plugin put into a dir
    searched earlier, and the lookup runs again. Refusals are not remembered."""

    _LIMIT = 256

    def __init__(self) -> None:
        self._found: dict[tuple[str, tuple[str, ...]], tuple[str, _Proof]] = {}

    def find(self, plugin: str, dirs: Sequence[str], verb: str) -> str:
        key = (plugin, tuple(dirs))
        hit = self._found.get(key)
        if hit is not None and hit[1].holds():
            return hit[0]
        path, proof = _find(plugin, dirs, verb)
        if proof is not None:
            if len(self._found) >= self._LIMIT:
                self._found.clear()
            self._found[key] = (path, proof)
        return path


def decode_json(plugin: str, verb: str, out: bytes) -> Any:
    """Parse a plugin's stdout; `null` (and nothing at all) mean `{}`."""
    text = out.strip()
    if not text or text == b"null":
        return {}
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise PluginBadOutput(
            plugin, verb, f"output is not JSON ({e}): {_excerpt(out)}"
        ) from None


# Control characters of a plugin's garbage, spelled out: a NUL in an error
# message cannot cross D-Bus, and a terminal should not act on an escape.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c not in (0x09, 0x0A)}


def _excerpt(data: bytes, limit: int = 200) -> str:
    """The start of what a plugin printed, for a person: invalid UTF-8 as `\\xNN`."""
    text = data[: limit * 4].decode("utf-8", "backslashreplace").strip().translate(_CONTROLS)
    return text if len(text) <= limit else text[:limit] + "…"


def _error_from_exit(plugin: str, verb: str, rc: int, out: bytes, err: bytes) -> ExecError | PluginError:
    """Turn a non-zero exit into the plugin's own error if it printed one."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return PluginKilled(plugin, verb, name)
    try:
        data = json.loads(out) if out.strip() else None
    except (ValueError, UnicodeDecodeError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("code"), int):
        return PluginError(
            plugin, verb, int(data["code"]), str(data.get("msg", "")),
            str(data.get("details", "") or ""),
        )
    text = _excerpt(out) or _excerpt(err) or "no output"
    return ExecError(plugin, verb, f"exited with status {rc} without an error result: {text}")


# Every plugin (and whatever it execs) carries this variable, so an agent
# restarted after a crash can find and kill what its predecessor left running —
# outside systemd's KillMode, nothing else would (see `kill_leftovers`).
INSTANCE_ENV = "CNI_AGENT_INSTANCE"


def kill_leftovers(instance: str, proc_dir: str = "/proc") -> list[int]:
    """SIGKILL every process whose environment carries our instance marker.

    Called at start-up, before any plugin of ours runs: a plugin still running
    then belongs to a killed predecessor and could otherwise finish an ADD
    after the new agent rolled that sandbox back.
    """
    marker = f"{INSTANCE_ENV}={instance}".encode()
    killed = []
    for name in os.listdir(proc_dir):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(os.path.join(proc_dir, name, "environ"), "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if marker in env:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
    return killed


class ProcessExecutor:
    """Spawns the plugin in its own process group, with a timeout and output caps."""

    def __init__(
        self,
        *,
        max_stdout: int = MAX_STDOUT,
        max_stderr: int = MAX_STDERR,
        busy_retries: int = 6,
        busy_delay: float = 0.2,
        base_env: Mapping[str, str] | None = None,
        instance: str = "",
        subreaper: bool = False,
    ) -> None:
        """`subreaper`: make this process the reaper of what plugins leave, and
        every child of it that is no plugin in flight a plugin's leftover (the
        daemon's choice: process-wide, and it starts nothing but plugins; see
        `leftovers`); without it what they leave in another session goes to
        init, unseen."""
        self._max_stdout = max_stdout
        self._max_stderr = max_stderr
        self._busy_retries = busy_retries
        self._busy_delay = busy_delay
        self._base_env = base_env
        self._instance = instance
        self._env_cache: dict[bytes, bytes] | None = None
        self._env_inv: Invocation | None = None  # whose CNI_* variables `_env` holds
        self._env: dict[bytes, bytes] = {}
        self._leftovers = Leftovers()
        self._lookups = PluginLookups()
        if subreaper:
            self._leftovers.adopt()

    def find(self, plugin: str, dirs: Sequence[str], verb: str) -> str:
        return self._lookups.find(plugin, dirs, verb)

    def _environ(self, inv: Invocation) -> dict[bytes, bytes]:
        """A plugin's environment, in bytes: posix_spawn takes them as they are
        (str it encodes, every variable on every run). The same dict while
        runs share `inv` (a chain's plugins do): only the caller's RUN_ENV
        changes, set right before each spawn."""
        if self._env_cache is None:
            # Built once: copying os.environ costs ~0.15 ms, on every plugin run.
            env = dict(os.environ if self._base_env is None else self._base_env)
            for key in _STRIPPED_ENV:
                env.pop(key, None)
            if self._instance:
                env[INSTANCE_ENV] = self._instance
            self._env_cache = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        if inv is not self._env_inv:
            self._env = {**self._env_cache,
                         **{k.encode(_FS_ENCODING, _FS_ERRORS): v.encode(_FS_ENCODING, _FS_ERRORS)
                            for k, v in inv.environ().items()}}
            self._env_inv = inv
        return self._env

    async def _spawn(self, plugin: str, binary: str, inv: Invocation, stdin: bytes,
                     timeout: float | None = None) -> Child:
        env = self._environ(inv)
        token = self._leftovers.token()
        marker = token.encode()
        for attempt in range(self._busy_retries + 1):
            env[_RUN_KEY] = marker  # before each try: another run may spawn while one waits
            try:
                return Child(binary, env, stdin, self._max_stdout, self._max_stderr,
                             leftovers=self._leftovers, token=token,
                             label=f"{plugin} {inv.command}", timeout=timeout)
            except OSError as e:
                # A binary being replaced (package upgrade) is briefly busy.
                if e.errno == errno.ETXTBSY and attempt < self._busy_retries:
                    await asyncio.sleep(self._busy_delay)
                    continue
                if e.errno == errno.ENOENT:
                    raise PluginNotFound(plugin, inv.command, f"{binary} vanished before exec") from None
                raise PluginNotExecutable(
                    plugin, inv.command, f"cannot execute {binary}: {e.strerror}"
                ) from None
        raise AssertionError("unreachable")

    async def execute(
        self, plugin: str, binary: str, inv: Invocation, stdin: bytes, timeout: float
    ) -> bytes:
        child = await self._spawn(plugin, binary, inv, stdin, timeout)
        try:
            await child.finished()  # or its timeout ran out (the child's own timer)
            if child.timed_out:
                raise PluginTimeout(plugin, inv.command, timeout)
            if child.too_big:
                raise PluginBadOutput(
                    plugin, inv.command,
                    f"printed more than {self._max_stdout} bytes (process group killed)",
                )
        finally:
            # Always, cancelled or not: kills a hung plugin and any children it
            # left behind, then reaps it.
            rc = child.reap_now()
            if rc is None:
                rc = await asyncio.shield(child.reap())
        out = child.stdout
        if rc is None:  # SIGKILLed at the deadline and not gone yet: an error anyway
            raise PluginKilled(plugin, inv.command, "SIGKILL")
        if rc != 0:
            raise _error_from_exit(plugin, inv.command, rc, out, child.stderr)
        return out
