"""A typed client of `org.cniagent.Agent1`: the D-Bus side of the CLI commands.

Low-level `dbus_fast.Message` calls on `dbus_fast.aio.MessageBus` (no proxy
objects, no introspection), so it works the same with Debian's dbus-fast 1.84
and PyPI's 5.x. No printing here: every call returns a typed value or raises
`ClientError`, whose `str()` is the one line a person reads (`meaning:
message`). `AgentUnavailable` (a `ClientError`) means the agent is not there
at all: the bus is unreachable or nothing owns the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, cast

from dbus_fast import Message, MessageFlag, MessageType, Variant
from dbus_fast.aio import MessageBus

from cni_agent.api import BUS_NAME, ERROR_PREFIX, INTERFACE, OBJECT_PATH, ErrorKind
from cni_agent.bus import connect
from cni_agent.cli.exits import EXIT_DENIED, EXIT_FAILED, EXIT_NOT_READY, EXIT_NOT_RUNNING, EXIT_USAGE
from cni_agent.cni.args import PodMeta

DBUS_NAME = DBUS_INTERFACE = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"
PROPERTIES = "org.freedesktop.DBus.Properties"
DBUS_ERROR = "org.freedesktop.DBus.Error."
DEFAULT_SYSTEM_BUS = "unix:path=/var/run/dbus/system_bus_socket"
START_HINT = ("start it with `systemctl start cni-agent`, "
              "or `cni-agent run` / `make run` for development")

# The bus daemon's own AccessDenied: the call never reached the agent. The
# policy the packages install (dbus/org.cniagent.Agent1.conf) lets every
# caller send to the interface and leaves every decision to the agent, whose
# own refusals are org.cniagent.Agent1.Error.AccessDenied with the reason.
BUS_POLICY_REFUSED = (
    "refused by the D-Bus daemon's policy, before cni-agent saw the call: the policy cni-agent "
    "installs lets every caller reach the interface and the agent decides, so a local policy "
    "in /etc/dbus-1/system.d/ (or an older org.cniagent.Agent1.conf the bus still has loaded) "
    "denies it")

QUICK_CALL_TIMEOUT = 30.0  # property reads, Show, ListSandboxes
WAIT_CHUNK = 20.0  # one WaitReady call waits at most this long; longer waits loop
CALL_MARGIN = 15.0  # extra client-side patience on top of the agent's own wait

MEANINGS: dict[str, str] = {
    ERROR_PREFIX + ErrorKind.INVALID_ARGUMENT: "invalid argument",
    ERROR_PREFIX + ErrorKind.NOT_READY: "network not ready",
    ERROR_PREFIX + ErrorKind.NOT_FOUND: "not found",
    ERROR_PREFIX + ErrorKind.BUSY: "busy",
    ERROR_PREFIX + ErrorKind.PLUGIN_FAILED: "plugin failed",
    ERROR_PREFIX + ErrorKind.TIMEOUT: "timed out",
    ERROR_PREFIX + ErrorKind.ACCESS_DENIED: "access denied",
    ERROR_PREFIX + ErrorKind.SHUTTING_DOWN: "agent shutting down",
    ERROR_PREFIX + ErrorKind.STATE_ERROR: "agent state error",
    DBUS_ERROR + "AccessDenied": "access denied",
    DBUS_ERROR + "NoReply": "no reply from the agent",
    DBUS_ERROR + "Timeout": "timed out",
    DBUS_ERROR + "TimedOut": "timed out",
    DBUS_ERROR + "UnknownMethod": "not supported by this agent",
    DBUS_ERROR + "InvalidArgs": "invalid argument",
}
NOT_RUNNING = frozenset({DBUS_ERROR + "ServiceUnknown", DBUS_ERROR + "NameHasNoOwner"})
# The exit status of each error (`cni_agent.cli.exits`); any other error is EXIT_FAILED.
EXIT_STATUSES: dict[str, int] = {
    ERROR_PREFIX + ErrorKind.INVALID_ARGUMENT: EXIT_USAGE,
    DBUS_ERROR + "InvalidArgs": EXIT_USAGE,
    ERROR_PREFIX + ErrorKind.NOT_READY: EXIT_NOT_READY,
    ERROR_PREFIX + ErrorKind.SHUTTING_DOWN: EXIT_NOT_READY,
    DBUS_ERROR + "NoReply": EXIT_NOT_READY,
    DBUS_ERROR + "Timeout": EXIT_NOT_READY,
    DBUS_ERROR + "TimedOut": EXIT_NOT_READY,
    ERROR_PREFIX + ErrorKind.ACCESS_DENIED: EXIT_DENIED,
    DBUS_ERROR + "AccessDenied": EXIT_DENIED,
    # The operation failed (the node's disk, not the caller's request).
    ERROR_PREFIX + ErrorKind.STATE_ERROR: EXIT_FAILED,
}


class ClientError(Exception):
    """A call that failed: a short `meaning` and the agent's (or bus's) message."""

    def __init__(self, meaning: str, message: str, name: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.meaning = meaning
        self.message = message
        self.name = name  # the D-Bus error name, when there was one
        # The CLI's exit status for it: given, else by the error's name.
        self.status = status if status is not None else EXIT_STATUSES.get(name, EXIT_FAILED)

    def __str__(self) -> str:
        text = " ".join(self.message.split())  # always one line
        if not text:
            return self.meaning
        if text.lower().startswith(self.meaning.lower()):  # no "not ready: not ready after…"
            return text
        return f"{self.meaning}: {text}"


class AgentUnavailable(ClientError):
    """The agent cannot be reached at all: no bus, or nobody owns the name."""

    def __init__(self, meaning: str, message: str, name: str = "") -> None:
        super().__init__(meaning, message, name, EXIT_NOT_RUNNING)


def describe_bus(bus: str) -> str:
    if bus == "system":
        return f"the system bus ({os.environ.get('DBUS_SYSTEM_BUS_ADDRESS') or DEFAULT_SYSTEM_BUS})"
    if bus == "session":
        return "the session bus"
    return f"the bus {bus}"


def error_from_reply(name: str, text: str, bus: str) -> ClientError:
    """The `ClientError` for a D-Bus error reply."""
    if name in NOT_RUNNING or name.startswith(DBUS_ERROR + "Spawn."):
        return AgentUnavailable(
            "agent not running",
            f"nothing owns {BUS_NAME} on {describe_bus(bus)}; {START_HINT}", name)
    if name == DBUS_ERROR + "AccessDenied":
        text = f"{text} ({BUS_POLICY_REFUSED})"
    meaning = MEANINGS.get(name)
    if meaning is None:  # an error this client does not know: show its name
        meaning = name.removeprefix(ERROR_PREFIX).removeprefix(DBUS_ERROR) or "D-Bus error"
    return ClientError(meaning, text, name)


# --- typed values ---------------------------------------------------------------------


@dataclass(frozen=True)
class AgentStatus:
    """The agent's properties; `running` is False only for the monitor's "agent left" state."""

    network_ready: bool
    status: str
    default_network: str = ""
    networks: tuple[str, ...] = ()
    last_error: str = ""
    pod_cidrs: tuple[str, ...] = ()
    # "config" or "saved" (SetPodCIDRs' value, overriding the config); "" from an
    # agent older than InterfaceRevision 3, which cannot say.
    pod_cidrs_source: str = ""
    running: bool = True

    @classmethod
    def from_properties(cls, props: Mapping[str, Any]) -> AgentStatus:
        """From GetAll's `a{sv}` (values as `Variant`s or already unwrapped)."""
        return cls(network_ready=False, status="").updated(props)

    @classmethod
    def gone(cls) -> AgentStatus:
        return cls(False, f"cni-agent stopped: {BUS_NAME} left the bus",
                   last_error="agent not running", running=False)

    def updated(self, changed: Mapping[str, Any]) -> AgentStatus:
        """A copy with PropertiesChanged's changed properties applied (unknown ones ignored)."""
        v = {k: (x.value if isinstance(x, Variant) else x) for k, x in changed.items()}
        fields: dict[str, Any] = {}
        if "NetworkReady" in v:
            fields["network_ready"] = bool(v["NetworkReady"])
        for prop, name in (("Status", "status"), ("DefaultNetwork", "default_network"),
                           ("LastError", "last_error"), ("PodCIDRsSource", "pod_cidrs_source")):
            if prop in v:
                fields[name] = str(v[prop])
        for prop, name in (("Networks", "networks"), ("PodCIDRs", "pod_cidrs")):
            if prop in v:
                fields[name] = tuple(str(x) for x in v[prop])
        return replace(self, **fields, running=True)

    def to_json(self) -> dict[str, Any]:
        return {"network_ready": self.network_ready, "status": self.status,
                "default_network": self.default_network, "networks": list(self.networks),
                "last_error": self.last_error, "pod_cidrs": list(self.pod_cidrs),
                "pod_cidrs_source": self.pod_cidrs_source}


def result_addresses(result: Mapping[str, Any]) -> tuple[str, ...]:
    """The IP addresses (CIDR form) of one CNI result, in any CNI result version."""
    out: list[str] = []
    for ip in result.get("ips") or ():
        if isinstance(ip, Mapping) and ip.get("address"):
            out.append(str(ip["address"]))
    for key in ("ip4", "ip6"):  # 0.1.0 / 0.2.0 results
        legacy = result.get(key)
        if isinstance(legacy, Mapping) and legacy.get("ip"):
            out.append(str(legacy["ip"]))
    return tuple(out)


@dataclass(frozen=True)
class Attachment:
    network: str
    ifname: str
    result: Mapping[str, Any]
    check: Mapping[str, Any] | None = None  # Show's check state (absent from Setup's)

    @property
    def addresses(self) -> tuple[str, ...]:
        return result_addresses(self.result)


@dataclass(frozen=True)
class SandboxResult:
    """Setup's and Show's result; `document` is the agent's JSON exactly as received."""

    sandbox: str
    attachments: tuple[Attachment, ...]
    document: Mapping[str, Any]

    @classmethod
    def parse(cls, text: str) -> SandboxResult:
        try:
            doc = json.loads(text)
            atts = tuple(Attachment(str(a["network"]), str(a["ifname"]), a.get("result") or {},
                                    a.get("check") if isinstance(a.get("check"), Mapping) else None)
                         for a in doc["attachments"])
            return cls(str(doc["sandbox"]), atts, doc)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ClientError("unexpected reply", f"the agent's result is not the documented JSON: "
                              f"{type(e).__name__}: {e}") from None


@dataclass(frozen=True)
class SetupOptions:
    """Setup's options; empty fields are left out (the agent's defaults apply)."""

    networks: tuple[tuple[str, str], ...] = ()  # (network, ifname); "" ifname = the agent picks
    args: tuple[tuple[str, str], ...] = ()
    pod: PodMeta | None = None
    capabilities: str | None = None  # a JSON object

    def to_dbus(self) -> dict[str, Variant]:
        out: dict[str, Variant] = {}
        if self.networks:
            out["networks"] = Variant("a(ss)", [[n, i] for n, i in self.networks])
        if self.args:
            out["args"] = Variant("a{ss}", dict(self.args))
        if self.pod is not None:
            pod = {"namespace": self.pod.namespace, "name": self.pod.name}
            if self.pod.uid:
                pod["uid"] = self.pod.uid
            out["pod"] = Variant("a{ss}", pod)
        if self.capabilities is not None:
            out["capabilities"] = Variant("s", self.capabilities)
        return out


def open_netns(path: str, missing_ok: bool = False) -> int | None:
    """The namespace at `path`, opened with the caller's own rights: the agent
    acts on a descriptor, never on a path it would open as root for a caller
    that may not (a path alone is accepted from root only).

    None for root when it cannot be opened: the agent then says why, in its
    words; anyone else gets the reason here (or, `missing_ok`, None when
    nothing is there: a Teardown of a namespace that is gone).
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as e:
        if os.geteuid() == 0:
            return None
        if missing_ok and e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if e.errno in (errno.EACCES, errno.EPERM):  # the caller's rights, not its typing
            raise ClientError("access denied", f"netns {path!r}: cannot open: {e.strerror}",
                              status=EXIT_DENIED) from None
        raise ClientError("invalid argument", f"netns {path!r}: cannot open: {e.strerror}",
                          status=EXIT_USAGE) from None


# --- sandbox events -------------------------------------------------------------------

EVENT_SIGNALS = frozenset({"SandboxChanged", "AttachmentDrifted", "AttachmentCheckChanged"})


def event_document(member: str, body: Sequence[Any]) -> dict[str, Any]:
    """A sandbox signal as `events --json` prints it (without its time):
    SandboxChanged as `{"sandbox", "change", "owner", "attachments": [{"network",
    "ifname", "state", "mac", "addresses"}]}`; the check signals as `{"sandbox",
    "change": "drifted" | "check", "network", "ifname", "state", "reason"}`."""
    if member == "SandboxChanged":
        sid, change, owner, attachments = body
        return {"sandbox": str(sid), "change": str(change), "owner": int(owner),
                "attachments": [{"network": str(n), "ifname": str(i), "state": str(st),
                                 "mac": str(mac), "addresses": [str(a) for a in addrs]}
                                for n, i, st, mac, addrs in attachments]}
    if member == "AttachmentDrifted":
        sid, network, ifname, reason = body
        return {"sandbox": str(sid), "change": "drifted", "network": str(network),
                "ifname": str(ifname), "state": "drifted", "reason": str(reason)}
    sid, network, ifname, state, reason = body
    return {"sandbox": str(sid), "change": "check", "network": str(network),
            "ifname": str(ifname), "state": str(state), "reason": str(reason)}


# --- the client -----------------------------------------------------------------------


class AgentClient:
    """One bus connection; use as `async with await AgentClient.connect(bus) as c:`."""

    def __init__(self, bus: MessageBus, bus_spec: str) -> None:
        self._bus = bus
        self.bus_spec = bus_spec

    @classmethod
    async def connect(cls, bus: str = "system") -> AgentClient:
        try:
            return cls(await connect(bus), bus)
        except (OSError, ValueError, KeyError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise AgentUnavailable(
                "agent not running",
                f"{describe_bus(bus)} is unreachable ({reason}); {START_HINT}") from None
        except Exception as e:  # e.g. dbus_fast.AuthError
            raise AgentUnavailable("cannot connect", f"{describe_bus(bus)}: {e}") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._bus.disconnect()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close()

    async def _call(self, member: str, signature: str = "", body: Sequence[Any] = (), *,
                    interface: str = INTERFACE, destination: str = BUS_NAME,
                    path: str = OBJECT_PATH, timeout: float | None = QUICK_CALL_TIMEOUT,
                    fds: Sequence[int] = (), auto_start: bool = True) -> list[Any]:
        msg = Message(destination=destination, path=path, interface=interface, member=member,
                      signature=signature, body=list(body), unix_fds=list(fds),
                      flags=MessageFlag(0) if auto_start else MessageFlag.NO_AUTOSTART)
        try:
            reply = await asyncio.wait_for(self._bus.call(msg), timeout)
        except TimeoutError:
            raise ClientError("timed out", f"no reply to {member} within {timeout:g}s",
                              status=EXIT_NOT_READY) from None
        except Exception as e:
            raise ClientError("lost the bus", f"{member}: the bus connection failed: {e}") from None
        if reply is None:
            raise ClientError("lost the bus", f"{member}: the bus connection closed")
        if reply.message_type is MessageType.ERROR:
            text = str(reply.body[0]) if reply.body else ""
            raise error_from_reply(reply.error_name or "", text, self.bus_spec)
        return list(reply.body)

    async def _add_match(self, rule: str) -> None:
        await self._call("AddMatch", "s", [rule], interface=DBUS_INTERFACE, destination=DBUS_NAME,
                         path=DBUS_PATH)

    # --- reads ------------------------------------------------------------------------

    async def status(self, auto_start: bool = True) -> AgentStatus:
        """The properties; `auto_start=False`: a stopped agent is not bus-activated
        to answer (`state` reports what is, `status` waits for a restart)."""
        [props] = await self._call("GetAll", "s", [INTERFACE], interface=PROPERTIES,
                                   auto_start=auto_start)
        return AgentStatus.from_properties(props)

    async def wait_ready(self, timeout: float) -> bool:
        """True once NetworkReady (at once if it is), False after `timeout` seconds.

        Waits in WaitReady calls of at most WAIT_CHUNK seconds, so no bus or
        client call timeout cuts a long wait short.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            chunk = min(max(0.0, deadline - loop.time()), WAIT_CHUNK)
            started = loop.time()
            [ready] = await self._call("WaitReady", "d", [chunk], timeout=chunk + CALL_MARGIN)
            if ready:
                return True
            now = loop.time()
            if now >= deadline:
                return False
            if now - started < chunk - 1.0:  # WaitReady answers False early only on shutdown
                raise ClientError("agent shutting down",
                                  "the agent stopped while waiting for network readiness",
                                  status=EXIT_NOT_READY)

    async def show(self, sandbox_id: str) -> SandboxResult:
        [text] = await self._call("Show", "s", [sandbox_id])
        return SandboxResult.parse(text)

    async def list_sandboxes(self) -> list[str]:
        [ids] = await self._call("ListSandboxes")
        return [str(i) for i in ids]

    async def network_capacity(self, network: str) -> dict[str, Any]:
        """NetworkCapacity's document for `network` ("" = the default network)."""
        [text] = await self._call("NetworkCapacity", "s", [network])
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ClientError("unexpected reply", f"NetworkCapacity answered {text[:80]!r}")
        return doc

    # --- changes ------------------------------------------------------------------------

    async def setup(self, sandbox_id: str, netns: str, options: SetupOptions) -> SandboxResult:
        fd = open_netns(netns)
        try:
            opts = options.to_dbus()
            if fd is not None:
                opts["netns_fd"] = Variant("h", 0)  # an index into the message's fds
            [text] = await self._call("Setup", "ssa{sv}", [sandbox_id, netns, opts],
                                      timeout=None,  # the agent enforces its own timeouts
                                      fds=[fd] if fd is not None else [])
        finally:
            if fd is not None:
                os.close(fd)
        return SandboxResult.parse(text)

    async def teardown(self, sandbox_id: str, netns: str = "") -> None:
        await self._with_netns("Teardown", sandbox_id, netns)

    async def check(self, sandbox_id: str, netns: str) -> None:
        await self._with_netns("Check", sandbox_id, netns)

    async def detach(self, sandbox_id: str, netns: str, network: str, ifname: str) -> None:
        await self._with_netns("Detach", sandbox_id, netns, network, ifname)

    async def _with_netns(self, method: str, sandbox_id: str, netns: str, *more: str) -> None:
        """A call on an existing sandbox naming its namespace: by a caller that
        is not root, as a descriptor it opens itself (the agent opens no path
        of its, and keeps no descriptor: each call passes it again); root's
        path is the agent's to open."""
        fd = None
        if netns and os.geteuid() != 0:
            # A removal's namespace may be gone already: the agent then finds no
            # process in it and removes the sandbox without it.
            fd = open_netns(netns, missing_ok=method != "Check")
        opts: dict[str, Variant] = {}
        if fd is not None:
            opts["netns_fd"] = Variant("h", 0)  # an index into the message's fds
        try:
            await self._call(method, "ss" + "s" * len(more) + "a{sv}",
                             [sandbox_id, netns, *more, opts], timeout=None,
                             fds=[fd] if fd is not None else [])
        finally:
            if fd is not None:
                os.close(fd)

    async def check_sandboxes(self, sandbox_ids: list[str]) -> list[dict[str, Any]]:
        """CHECK now; every attachment's check state (CheckSandboxes)."""
        [text] = await self._call("CheckSandboxes", "as", [sandbox_ids], timeout=None)
        try:
            rows = json.loads(text)["attachments"]
            if not isinstance(rows, list):
                raise TypeError("attachments is not a list")
        except (ValueError, TypeError, KeyError) as e:
            raise ClientError("unexpected reply", f"the agent's check report is not the "
                              f"documented JSON: {type(e).__name__}: {e}") from None
        return [dict(r) for r in rows]

    async def set_pod_cidrs(self, cidrs: Sequence[str]) -> None:
        await self._call("SetPodCIDRs", "as", [list(cidrs)])

    async def reset_pod_cidrs(self) -> None:
        await self._call("ResetPodCIDRs")

    # --- watching -----------------------------------------------------------------------

    async def watch(self) -> AsyncGenerator[AgentStatus, None]:
        """The current status, then each status that differs from the one before.

        Subscribes before reading, so no change is lost between the two. When
        the agent leaves the bus this yields `AgentStatus.gone()`, and the
        agent's state again once it is back. Ends only by raising
        `ClientError` (the bus connection is lost) or by being closed.
        """
        def wanted(msg: Message) -> bool:
            return (msg.member == "PropertiesChanged" and msg.interface == PROPERTIES
                    and msg.path == OBJECT_PATH and msg.body[0] == INTERFACE)

        async with self._signals(wanted) as next_signal:
            await self._add_match(
                f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',"
                f"interface='{PROPERTIES}',member='PropertiesChanged',arg0='{INTERFACE}'")
            state = await self.status()
            yield state
            while True:
                new = await self._apply(state, await next_signal())
                if new != state:
                    state = new
                    yield state

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """Each sandbox event the agent sends this connection, as a JSON-ready
        object (`event_document`), from WatchSandboxes on.

        The signals are unicast to this connection (no match rule needed); the
        agent leaving the bus yields `{"agent_running": False}`, and once it
        is back this watches again and yields `{"agent_running": True}`
        (what happened meanwhile is not told). Ends only by raising
        `ClientError` (the bus connection is lost, WatchSandboxes refused) or
        by being closed."""
        def wanted(msg: Message) -> bool:
            return (msg.path == OBJECT_PATH and msg.interface == INTERFACE
                    and msg.member in EVENT_SIGNALS)

        async with self._signals(wanted) as next_signal:
            await self._call("WatchSandboxes")
            while True:
                msg = await next_signal()
                if msg.member == "NameOwnerChanged":
                    if not msg.body[2]:
                        yield {"agent_running": False}
                        continue
                    try:
                        await self._call("WatchSandboxes")
                    except AgentUnavailable:  # came and went already
                        continue
                    yield {"agent_running": True}
                    continue
                yield event_document(str(msg.member), list(msg.body))

    @contextlib.asynccontextmanager
    async def _signals(self, wanted: Callable[[Message], bool]
                       ) -> AsyncIterator[Callable[[], Awaitable[Message]]]:
        """While open, the signals `wanted` picks and the agent's own
        NameOwnerChanged (its match added here), in order: the function
        yielded awaits the next one, and raises ClientError once the bus
        connection is lost."""
        queue: asyncio.Queue[Message | None] = asyncio.Queue()

        def on_message(msg: Message) -> None:
            if msg.message_type is not MessageType.SIGNAL or not msg.body:
                return
            if wanted(msg) or (msg.member == "NameOwnerChanged" and msg.interface == DBUS_INTERFACE
                               and msg.body[0] == BUS_NAME):
                queue.put_nowait(msg)

        disconnected = cast(Callable[[], Awaitable[None]], self._bus.wait_for_disconnect)

        async def on_disconnect() -> None:
            with contextlib.suppress(Exception):
                await disconnected()
            queue.put_nowait(None)

        async def next_signal() -> Message:
            msg = await queue.get()
            if msg is None:
                raise ClientError("lost the bus", f"the connection to "
                                  f"{describe_bus(self.bus_spec)} was closed")
            return msg

        self._bus.add_message_handler(on_message)
        lost = asyncio.create_task(on_disconnect())
        try:
            await self._add_match(
                f"type='signal',sender='{DBUS_NAME}',interface='{DBUS_INTERFACE}',"
                f"member='NameOwnerChanged',arg0='{BUS_NAME}'")
            yield next_signal
        finally:
            lost.cancel()
            self._bus.remove_message_handler(on_message)

    async def _apply(self, state: AgentStatus, msg: Message) -> AgentStatus:
        if msg.member == "NameOwnerChanged":
            if not msg.body[2]:
                return AgentStatus.gone()
            try:
                return await self.status()
            except AgentUnavailable:  # came and went already
                return AgentStatus.gone()
        _, changed, invalidated = msg.body
        if invalidated:
            return await self.status()
        return state.updated(changed)
