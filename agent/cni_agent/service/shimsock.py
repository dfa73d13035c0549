"""The shim's own socket: a runtime's CNI call without the bus hop.

Over D-Bus each exec of cni-agent-shim costs about three round trips through
the bus daemon (the shim's Hello, the call, the agent's
GetConnectionCredentials of the new connection) and libsystemd's start-up;
here it is one connect and one exchange. The call is the D-Bus CNICall's:
`Callers.serve` (the caller's role from SO_PEERCRED and SO_PEERGROUPS, as
the bus daemon reads them; the policy; the rates and shares of callers that
are not root, shared with the bus; the drain's count) and `cnicall`, and a
failure comes back as the same error name and message, so the shim turns it
into the same CNI error. The
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
(STRANGER_CONNECTIONS in all). The rates and shares are the bus's, counted
together (`limits`): a caller is known by SO_PEERCRED at once, so nothing
waits for a lookup here; over a rate, Busy after the tarpit's delay; root's
calls are never counted nor made to wait. Every request is answered, a
malformed one with InvalidArgument saying what is wrong.
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
from typing import cast

from cni_agent.api import ERROR_PREFIX, AgentError, ErrorKind
from cni_agent.sandboxes.policy import Caller, Role, cnicall_scope
from cni_agent.service.auth import groups_of_user
from cni_agent.service.callers import (
    UNPRIVILEGED_MAX_STDIN,
    Callers,
    Credentials,
    check_cnicall,
    cnicall,
    error_of,
    invalid,
)
from cni_agent.service.cnicall import MAX_CONFIG, ShimCalls, command_of
from cni_agent.service.limits import IN_FLIGHT

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
_PEERCRED = struct.Struct("iII")  # pid, uid, gid (struct ucred)
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


def _decode(data: bytes | bytearray, what: str) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise invalid("request", f"the {what} is not valid UTF-8") from None


def parse_env(data: bytes | bytearray) -> dict[str, str]:
    if data and not data.endswith(b"\0"):
        raise invalid("environment", "each KEY=VALUE entry must end with a NUL byte")
    env = {}
    for entry in _decode(data, "environment").split("\0")[:-1]:
        key, eq, value = entry.partition("=")
        if not eq or not key:
            raise invalid("environment", f"{entry[:60]!r} is not KEY=VALUE")
        env[key] = value
    return env


class RequestParser:
    """One request, as its bytes arrive: `feed` returns it once whole, raises
    AgentError as soon as it cannot be one (a length past its bound is refused
    before what it announces is read)."""

    def __init__(self, config_bound: int) -> None:
        self.buf = bytearray()
        self.config_bound = config_bound

    def feed(self, data: bytes) -> Request | None:
        self.buf += data
        b = self.buf
        if b[:len(MAGIC)] != MAGIC[:len(b)]:
            raise invalid("request", f"not a cni-agent-shim request (it must begin with "
                                     f"{MAGIC.decode()})")
        if len(b) < 8:
            return None
        env_len = _U32.unpack_from(b, 4)[0]
        if env_len > MAX_ENV:
            raise invalid("environment", f"larger than {MAX_ENV} bytes")
        head = 8 + env_len + _U32.size
        if len(b) < head:
            return None
        config_len = _U32.unpack_from(b, head - _U32.size)[0]
        if config_len > self.config_bound:
            return Request(parse_env(b[8:8 + env_len]), None, config_len)
        if len(b) < head + config_len:
            return None
        return Request(parse_env(b[8:8 + env_len]),
                       _decode(b[head:head + config_len], "configuration"), config_len)

    def ended(self) -> AgentError:
        return invalid("request", f"it ended after {len(self.buf)} bytes, before its end")


class ShimSocket:
    def __init__(self, path: str, callers: Callers, shim: ShimCalls,
                 on_operation: Callable[[str, str, float], None] = lambda m, r, s: None) -> None:
        self.path = path
        self.callers = callers
        self.shim = shim
        self._on_operation = on_operation  # as the bus's: ("CNICall", result, seconds)
        self._server: asyncio.AbstractServer | None = None
        self._inode = 0
        self._connections: set[_Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
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
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: _Connection(self), sock=sock)
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
        await self.callers.in_flight.wait_idle()
        for conn in list(self._connections):
            conn.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)

    # --- one call ---------------------------------------------------------------------

    def admit_connection(self, caller: Caller) -> bool:
        """Another connection of `caller`, within a stranger's bounds."""
        if caller.role is not Role.STRANGER:
            return True
        if (self._strangers[caller.uid] >= CONNECTIONS
                or sum(self._strangers.values()) >= STRANGER_CONNECTIONS):
            self._on_operation("CNICall", str(ErrorKind.BUSY), 0.0)
            return False
        self._strangers[caller.uid] += 1
        return True

    def release_connection(self, caller: Caller) -> None:
        if caller.role is Role.STRANGER:
            self._strangers[caller.uid] -= 1
            if not self._strangers[caller.uid]:
                del self._strangers[caller.uid]

    async def answer(self, caller: Caller, credentials: Credentials,
                     request: Request | AgentError) -> bytes:
        """The reply to one request (or to what stood for one), whatever happens."""
        arrived = time.monotonic()
        result = "Cancelled"  # the agent is stopping, unless set below
        try:
            # A stranger's malformed request counts against its rate too.
            counted = await self._rate(caller)
            if isinstance(request, AgentError):
                raise request
            call = request
            status, output = await self.callers.serve(
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
        """A call against its caller's rates, as the bus's gate takes them
        (a stranger's uid's, all strangers', all members'): over one, Busy
        after the tarpit's delay (at once when too many wait). Root: none."""
        if caller.role is Role.ROOT:
            return False
        limits = self.callers.limits
        over = limits.take(caller)
        if over is None:
            return True
        delayed = asyncio.Event()
        if limits.tarpit(delayed.set):
            await delayed.wait()
        raise over

    async def _work(self, caller: Caller, request: Request) -> tuple[int, str]:
        if request.config is None:  # not read: over the caller's bound
            check_cnicall(caller, request.env, request.config_len)
            raise invalid("config", f"larger than {MAX_CONFIG} bytes")
        return await cnicall(self.shim, caller, request.env, request.config)


class _Connection(asyncio.Protocol):
    """One connection: the request read as it arrives (never blocking the
    loop), then one task for the call, its reply, and the end."""

    def __init__(self, server: ShimSocket) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.caller: Caller | None = None
        self.credentials: Credentials = (-1, frozenset())
        self.parser: RequestParser | None = None  # None: not reading (refused, or done)
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's stream transport is not an asyncio.Transport subclass; it has its methods.
        self.transport = transport = cast(asyncio.Transport, transport)
        try:
            self.credentials = peer_credentials(transport.get_extra_info("socket"))
        except OSError as e:  # not a connection a process made
            log.warning("the shim's socket: no credentials for a connection: %s", e)
            transport.abort()
            return
        caller = self.server.callers.authorizer.caller(*self.credentials)
        if not self.server.admit_connection(caller):
            self._send(refusal(AgentError(
                ErrorKind.BUSY, f"at most {CONNECTIONS} connections at once per uid to the "
                                "shim's socket (for callers neither root nor in the access "
                                "group)")))
            return
        self.caller = caller
        self.server._connections.add(self)
        self.parser = RequestParser(MAX_CONFIG if caller.privileged else UNPRIVILEGED_MAX_STDIN)
        self.timer = asyncio.get_running_loop().call_later(
            READ_TIMEOUT, self._begin, AgentError(
                ErrorKind.TIMEOUT, f"the request did not arrive whole within {READ_TIMEOUT:g}s"))

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return  # being answered: what follows is not read
        try:
            request = self.parser.feed(data)
        except AgentError as e:
            self._begin(e)
            return
        if request is not None:
            self._begin(request)

    def eof_received(self) -> bool:
        if self.parser is not None:
            self._begin(self.parser.ended())
        return True  # the writing side stays open for the answer

    def _begin(self, request: Request | AgentError) -> None:
        """The request is whole, or stands for one (malformed, too late)."""
        assert self.transport is not None and self.caller is not None
        self.parser = None
        if self.timer is not None:
            self.timer.cancel()
        self.transport.pause_reading()
        self.task = asyncio.get_running_loop().create_task(self._serve(self.caller, request))
        self.server._tasks.add(self.task)
        self.task.add_done_callback(self.server._tasks.discard)

    async def _serve(self, caller: Caller, request: Request | AgentError) -> None:
        try:
            reply = await self.server.answer(caller, self.credentials, request)
        except asyncio.CancelledError:  # the agent is stopping (counted as Cancelled)
            reply = refusal(AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down"))
        self._send(reply)

    def _send(self, reply: bytes) -> None:
        """The reply, then the end once it is all out; a client that has not
        taken it within WRITE_TIMEOUT is dropped with it. A client that left
        meanwhile gets nothing (its call was finished all the same)."""
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            return
        transport.write(reply)
        if transport.get_write_buffer_size():
            if self.timer is not None:
                self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_later(WRITE_TIMEOUT, transport.abort)
        transport.close()

    def stop(self) -> None:
        """The agent is stopping: a call is answered ShuttingDown, and so is a
        request still arriving."""
        if self.task is not None:
            self.task.cancel()
        elif self.parser is not None:
            self.parser = None
            if self.timer is not None:
                self.timer.cancel()
            self._send(refusal(AgentError(ErrorKind.SHUTTING_DOWN, "cni-agent is shutting down")))

    def connection_lost(self, exc: Exception | None) -> None:
        self.parser = None
        if self.timer is not None:
            self.timer.cancel()
        if self.caller is not None:
            self.server.release_connection(self.caller)
            self.server._connections.discard(self)
            self.caller = None
