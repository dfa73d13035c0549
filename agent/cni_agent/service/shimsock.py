"""The shim's own socket: a runtime's CNI call without the bus hop.

Over D-Bus each exec of cni-agent-shim costs about three round trips through
the bus daemon (the shim's Hello, the call, the agent's
GetConnectionCredentials of the new connection) and libsystemd's start-up;
here it is one connect and one exchange. The call is the D-Bus CNICall's:
`Admission.serve` (the caller's role from SO_PEERCRED and SO_PEERGROUPS, as
the bus daemon reads them; the policy; strangers' bounds, shared with the
bus; the drain's count) and `cnicall`, and a failure comes back as the same
error name and message, so the shim turns it into the same CNI error. The
D-Bus API stays for every other client, and the shim falls back to it when
this socket is not there (bus activation starts a stopped agent).

Protocol, integers unsigned 32-bit big-endian, one request per connection:

    request: "CNA1" env_len env config_len config
             env: KEY=VALUE entries, each ended by a NUL; config: stdin (UTF-8)
    reply:   "CNA1" exit_status name_len text_len name text
             name empty: text is the plugin's stdout; else the D-Bus error
             name of the failure (org.cniagent.Agent1.Error.*), text its message

Bounds: the env at most MAX_ENV bytes, the config MAX_CONFIG (strangers:
UNPRIVILEGED_MAX_STDIN, refused unread beyond); the whole request within
READ_TIMEOUT of connecting; a reply not taken within WRITE_TIMEOUT (a client
that stops reading) is dropped. Strangers: CONNECTIONS at once per uid
(STRANGER_CONNECTIONS in all), their rate as on the bus (over it, Busy after
the tarpit's delay). Every request is answered, a malformed one with
InvalidArgument saying what is wrong.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cni_agent.api import ERROR_PREFIX, AgentError, ErrorKind
from cni_agent.sandboxes.policy import Caller, Role, cnicall_scope
from cni_agent.service.admission import (
    UNPRIVILEGED_MAX_STDIN,
    Admission,
    Credentials,
    check_cnicall,
    cnicall,
    error_of,
    invalid,
    sendable,
)
from cni_agent.service.auth import groups_of_user
from cni_agent.service.cnicall import MAX_CONFIG, ShimCalls, command_of
from cni_agent.service.limits import IN_FLIGHT, MAX_TARPIT, TARPIT

log = logging.getLogger(__name__)

SOCKET_NAME = "shim.sock"  # in runtime_dir
MAGIC = b"CNA1"
MAX_ENV = 64 * 1024
READ_TIMEOUT = 5.0
WRITE_TIMEOUT = 5.0
CONNECTIONS = IN_FLIGHT  # a stranger's at once, per uid
STRANGER_CONNECTIONS = 256  # all strangers' at once
STOP_TIMEOUT = 2.0  # for the answers to what is left at close
_U32 = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13
_MAX_GROUPS = 65536


def peer_credentials(sock: socket.socket) -> Credentials:
    """The connecting process's uid and groups, as the bus daemon reads them
    (its gid and supplementary groups), fixed when it connected."""
    _pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      _PEERCRED.size))
    gids: frozenset[int] | None = None
    for size in (64, _MAX_GROUPS):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * size)
        except OSError:  # ERANGE: more groups than that; or an older kernel
            continue
        gids = frozenset(struct.unpack(f"{len(raw) // 4}I", raw))
        break
    if gids is None:
        gids = groups_of_user(uid)
    return uid, gids | {gid}


def encode_reply(status: int, name: str, text: str) -> bytes:
    name_b, text_b = name.encode(), text.encode("utf-8", "replace")
    return b"".join((MAGIC, _U32.pack(status), _U32.pack(len(name_b)), _U32.pack(len(text_b)),
                     name_b, text_b))


def refusal(e: AgentError) -> bytes:
    return encode_reply(0, ERROR_PREFIX + str(e.kind), e.message)


@dataclass(frozen=True)
class Request:
    env: dict[str, str]
    config: str | None  # None: longer than the caller may send (`config_len`), not read
    config_len: int


def _decode(data: bytes, what: str) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise invalid("request", f"the {what} is not valid UTF-8") from None


def parse_env(data: bytes) -> dict[str, str]:
    if data and not data.endswith(b"\0"):
        raise invalid("environment", "each KEY=VALUE entry must end with a NUL byte")
    env = {}
    for entry in _decode(data, "environment").split("\0")[:-1]:
        key, eq, value = entry.partition("=")
        if not eq or not key:
            raise invalid("environment", f"{entry[:60]!r} is not KEY=VALUE")
        env[key] = value
    return env


async def read_request(reader: asyncio.StreamReader, config_bound: int) -> Request:
    """One request; AgentError when malformed (a client that closed early included)."""
    try:
        if await reader.readexactly(len(MAGIC)) != MAGIC:
            raise invalid("request", "not a cni-agent-shim request (it must begin with "
                                     f"{MAGIC.decode()})")
        env_len = _U32.unpack(await reader.readexactly(_U32.size))[0]
        if env_len > MAX_ENV:
            raise invalid("environment", f"larger than {MAX_ENV} bytes")
        env = parse_env(await reader.readexactly(env_len))
        config_len = _U32.unpack(await reader.readexactly(_U32.size))[0]
        if config_len > config_bound:
            return Request(env, None, config_len)
        config = _decode(await reader.readexactly(config_len), "configuration")
    except asyncio.IncompleteReadError as e:
        raise invalid("request", f"it ended after {len(e.partial)} more byte(s), before its "
                                 "end") from None
    return Request(env, config, config_len)


class ShimSocket:
    def __init__(self, path: str, admission: Admission, shim: ShimCalls,
                 on_operation: Callable[[str, str, float], None] = lambda m, r, s: None) -> None:
        self.path = path
        self.admission = admission
        self.shim = shim
        self._on_operation = on_operation  # as the bus's: ("CNICall", result, seconds)
        self._server: asyncio.Server | None = None
        self._inode = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._strangers: collections.Counter[int] = collections.Counter()

    async def start(self) -> None:
        """Listen at `path`, replacing what an earlier run left there; OSError if we cannot.

        Bound under a temporary name and renamed into place, so the path is
        never a socket nobody may connect to (mode 0666: anyone may call
        STATUS and VERSION; the agent decides per call from SO_PEERCRED)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            sock.bind(tmp)
            os.chmod(tmp, 0o666)
            sock.listen(socket.SOMAXCONN)
            os.rename(tmp, self.path)
            self._inode = os.stat(self.path).st_ino
            self._server = await asyncio.start_unix_server(self._connection, sock=sock)
        except BaseException:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def stop_listening(self) -> None:
        """No new connections: the shim then takes the bus (this agent until it
        releases its name, then the next one, which bus activation starts)."""
        if self._server is None:
            return
        self._server.close()
        self._server = None
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._inode:  # not a newer agent's
                os.unlink(self.path)

    async def close(self) -> None:
        """Stop listening; let the privileged calls that came meanwhile finish (the
        drain waits for those); answer whatever is left ShuttingDown."""
        self.stop_listening()
        await self.admission.in_flight.wait_idle()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)

    # --- one connection ------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        stranger: int | None = None
        try:
            credentials = peer_credentials(writer.get_extra_info("socket"))
            caller = self.admission.authorizer.caller(*credentials)
            if caller.role is Role.STRANGER:
                if (self._strangers[caller.uid] >= CONNECTIONS
                        or sum(self._strangers.values()) >= STRANGER_CONNECTIONS):
                    self._on_operation("CNICall", str(ErrorKind.BUSY), 0.0)
                    await self._send(writer, refusal(AgentError(
                        ErrorKind.BUSY, f"at most {CONNECTIONS} connections at once per uid to "
                                        "the shim's socket (for callers neither root nor in the "
                                        "access group)")))
                    return
                stranger = caller.uid
                self._strangers[stranger] += 1
            try:
                reply = await self._answer(reader, caller, credentials)
            except asyncio.CancelledError:  # the agent is stopping (counted as Cancelled)
                reply = refusal(AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down"))
            await self._send(writer, reply)
        except Exception:
            log.exception("the shim's socket: a connection failed")
        finally:
            if stranger is not None:
                self._strangers[stranger] -= 1
                if not self._strangers[stranger]:
                    del self._strangers[stranger]
            writer.transport.abort()  # whatever the state: the descriptor goes now
            self._tasks.discard(task)

    async def _send(self, writer: asyncio.StreamWriter, reply: bytes) -> None:
        """The reply, then the connection closed once it is all out (dropped
        when the client has not taken it within WRITE_TIMEOUT)."""
        writer.write(reply)
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(WRITE_TIMEOUT):
                writer.close()
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, caller: Caller,
                      credentials: Credentials) -> bytes:
        """The reply to this connection's request, whatever happens."""
        arrived = time.monotonic()
        result = "Cancelled"
        try:
            request: Request | AgentError
            try:
                async with asyncio.timeout(READ_TIMEOUT):
                    request = await read_request(
                        reader, MAX_CONFIG if caller.privileged else UNPRIVILEGED_MAX_STDIN)
            except TimeoutError:
                request = AgentError(ErrorKind.TIMEOUT, "the request did not arrive whole "
                                                        f"within {READ_TIMEOUT:g}s")
            except AgentError as e:
                request = e
            # A stranger's malformed request counts against its rate too.
            counted = await self._rate(caller)
            if isinstance(request, AgentError):
                raise request
            call = request
            status, output = await self.admission.serve(
                "CNICall", cnicall_scope(command_of(call.env)), credentials,
                lambda admitted: self._work(admitted, call), counted=counted)
            result = "ok"
            return encode_reply(status, "", output)
        except Exception as e:
            name, message = error_of("CNICall", e)
            result = name.rsplit(".", 1)[-1]
            return encode_reply(0, name, message)
        finally:
            self._on_operation("CNICall", result, time.monotonic() - arrived)

    async def _rate(self, caller: Caller) -> bool:
        """A stranger's call against its uid's rate, as the bus's gate takes it:
        over it, Busy after the tarpit's delay (at once when too many wait)."""
        if caller.role is not Role.STRANGER:
            return False
        limits = self.admission.limits
        if limits.take(caller.uid):
            return True
        if limits.tarpitted < MAX_TARPIT:
            limits.tarpitted += 1
            try:
                await asyncio.sleep(TARPIT)
            finally:
                limits.tarpitted -= 1
        raise limits.over_rate()

    async def _work(self, caller: Caller, request: Request) -> tuple[int, str]:
        if request.config is None:  # not read: over the caller's bound
            check_cnicall(caller, request.env, request.config_len)
            raise invalid("config", f"larger than {MAX_CONFIG} bytes")
        return sendable(await cnicall(self.shim, caller, request.env, request.config))
