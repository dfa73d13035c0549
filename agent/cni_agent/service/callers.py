"""Who calls, whether it may, within which bounds: the one path a call takes
into the agent, whichever transport carried it (the system bus, or the shim's
own socket, `shimsock`). Not `sandboxes.admission`, which counts what a
caller holds once it is in.

From the caller's credentials (uid and groups: the bus's for a D-Bus call,
SO_PEERCRED and SO_PEERGROUPS for the shim's socket) to its role (root, a
member, a stranger); whether the policy lets it call (polkit where it may
decide); the bounds of callers that are not root (`limits`: rates and
shares of the calls served, per uid and per class, root's calls first;
shared by both transports, so two ways in are not twice the budget);
and the count of the privileged calls a shutdown's drain waits for
(`InFlight`). Also what a CNICall answers, bounded for strangers, and how a
failure is named to the caller: the same words on both transports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from dbus_fast.errors import DBusError

from cni_agent.api import ERROR_PREFIX, AgentError, ErrorKind, wire_text
from cni_agent.cni.errors import InvalidArgument
from cni_agent.cni.tracectx import TRACE_ENV
from cni_agent.sandboxes.errors import classify
from cni_agent.sandboxes.policy import Caller, Role, Scope
from cni_agent.service.auth import Authorizer
from cni_agent.service.cnicall import ShimCalls
from cni_agent.service.limits import Limits

log = logging.getLogger(__name__)

T = TypeVar("T")

# CNICall's bounds: variables of the environment, and for callers that are
# neither root nor in the access group (their reads), stdin and the reply.
MAX_CNI_ENV = 64
UNPRIVILEGED_MAX_STDIN = 64 * 1024
UNPRIVILEGED_MAX_REPLY = 64 * 1024

# Calls that only read: a runtime or a monitor polling them says nothing about
# work to come, so they never hold a drain up (CNICall STATUS and VERSION too).
READS = frozenset({"WaitReady", "Show", "ListSandboxes", "NetworkCapacity"})
# Calls that only wait (for readiness, up to a day): counted against the
# caller's uid, but holding no slot of its class's share while they wait.
WAITS = frozenset({"WaitReady"})

Credentials = tuple[int, frozenset[int]]  # uid, gids


class InFlight:
    """Counts requests being served, so shutdown can wait for them, and when the
    last call that changes something arrived or ended, so an idle drain can end
    early (a poller of STATUS or the properties must not hold a restart up)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.count = 0
        self._clock = clock
        self.last_activity = clock()
        self._idle = asyncio.Event()
        self._idle.set()

    def touch(self) -> None:
        """A call that changes something arrived, or was answered (a caller's
        next call tends to follow its last answer)."""
        self.last_activity = self._clock()

    def __enter__(self) -> None:
        self.count += 1
        self._idle.clear()

    def __exit__(self, *exc: object) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


def invalid(field: str, reason: str) -> AgentError:
    return AgentError(ErrorKind.INVALID_ARGUMENT, f"{field}: {reason}")


def error_of(name: str, e: Exception) -> tuple[str, str]:
    """A call's failure as the contract's error name and its message (text a
    D-Bus string can carry: `wire_text`). Call it from the `except` that caught
    `e`: an unexpected failure is logged with its traceback."""
    if isinstance(e, AgentError):
        return ERROR_PREFIX + str(e.kind), wire_text(e.message)
    if isinstance(e, DBusError):
        return str(e.type), e.text
    if not isinstance(e, InvalidArgument):
        log.exception("%s failed unexpectedly", name)
    err = classify(e)
    return ERROR_PREFIX + str(err.kind), wire_text(err.message)


def sendable(value: T) -> T:
    """`value` if D-Bus can carry it, else a named error: dbus-fast marshals a
    reply in a callback, where a NUL or a lone surrogate in a string fails it
    (5.x answers a generic ServiceError, 1.84 with a traceback). Our results
    are ASCII JSON and checked ids, so this only catches a defect; it costs
    a scan of the strings, not a second marshalling. The shim's socket could
    carry more, but answers the same: the shim must not tell them apart."""
    if isinstance(value, str):
        if (not value.isascii() or "\0" in value) and wire_text(value, len(value)) != value:
            raise AgentError(ErrorKind.PLUGIN_FAILED, "internal error: the reply holds text "
                             f"D-Bus cannot carry: {wire_text(value, 200)}")
    elif isinstance(value, list | tuple):
        for item in value:
            sendable(item)
    return value


class Callers:
    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer
        self.limits = Limits()
        self.in_flight = InFlight()

    async def serve(self, name: str, scope: Scope, credentials: Credentials,
                    work: Callable[[Caller], Awaitable[T]], *, sender: str | None = None,
                    counted: bool = False, interactive: bool = False) -> T:
        """Serve one call of method `name`: who calls, from `credentials`;
        within its rates (`counted`: already taken by the transport); whether
        the policy lets it (polkit, where it may decide, for a bus `sender`);
        then `work(caller)` within its class's share (root's at once), whose
        result must be `sendable`. A stranger waits for polkit within the
        strangers' share; once authorized, its work is in the members'. Only
        calls of root, members and whom polkit authorized count for the
        shutdown's drain."""
        caller = self.authorizer.caller(*credentials)
        if not counted:
            over = self.limits.take(caller)
            if over is not None:
                raise over
        slot = name not in WAITS
        if caller.role is Role.STRANGER:
            async with self.limits.share(caller, slot):
                caller = await self.authorizer.authorize(caller, sender, name, scope, interactive)
                if caller.role is Role.STRANGER:  # a read, within the strangers' share
                    return sendable(await work(caller))
        else:
            caller = await self.authorizer.authorize(caller, sender, name, scope, interactive)
        # Counted for the drain while it waits for its share too: a member's
        # call accepted before SIGTERM is served, not dropped.
        return sendable(await self._counted(name, scope,
                                            lambda: self._shared(caller, work, slot)))

    async def _shared(self, caller: Caller, work: Callable[[Caller], Awaitable[T]],
                      slot: bool) -> T:
        async with self.limits.share(caller, slot):
            return await work(caller)

    async def _counted(self, name: str, scope: Scope, work: Callable[[], Awaitable[T]]) -> T:
        """In flight for the drain; a call that may change something also marks
        activity (a caller's next call tends to follow its last answer)."""
        work_to_come = scope is not Scope.OPEN and name not in READS
        with self.in_flight:
            if work_to_come:
                self.in_flight.touch()
            try:
                return await work()
            finally:
                if work_to_come:
                    self.in_flight.touch()


def check_cnicall(caller: Caller, environment: Mapping[str, str], stdin_bytes: int) -> None:
    """CNICall's bounds: the environment's size, and a stranger's stdin."""
    if len(environment) > MAX_CNI_ENV:
        raise invalid("environment", f"more than {MAX_CNI_ENV} variables")
    if not caller.privileged and stdin_bytes > UNPRIVILEGED_MAX_STDIN:
        raise invalid("config", f"larger than {UNPRIVILEGED_MAX_STDIN} bytes (the limit for "
                                "callers neither root nor in the access group)")


async def cnicall(shim: ShimCalls, caller: Caller, environment: Mapping[str, str],
                  config: str) -> tuple[int, str]:
    """CNICall's work, once admitted: (exit status, stdout) as a plugin answers."""
    check_cnicall(caller, environment, len(config.encode()))
    # The CNI_* variables, and the runtime's W3C trace context (libcni 1.3
    # gives plugins TRACEPARENT, TRACESTATE and BAGGAGE: cni/tracectx.py).
    env = {k: v for k, v in environment.items() if k.startswith("CNI_") or k in TRACE_ENV}
    answer = await shim.handle(env, config)
    output = answer.output
    if not caller.privileged and len(output) > UNPRIVILEGED_MAX_REPLY:
        output = output[:UNPRIVILEGED_MAX_REPLY]
    return answer.exit_status, output
