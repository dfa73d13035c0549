"""The D-Bus adapter: `org.cniagent.Agent1` at `/org/cniagent/Agent1`.

Thin on purpose: parse and check the D-Bus arguments, authorize the caller,
call the sandbox manager or monitor, and turn every failure into one of the
contract's error names with a message a person can act on.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from dbus_fast import Variant
from dbus_fast.constants import PropertyAccess
from dbus_fast.errors import DBusError
from dbus_fast.service import ServiceInterface, dbus_property, method, signal

from cni_agent import __version__
from cni_agent.api import (
    INTERFACE,
    INTERFACE_REVISION,
    AgentError,
    ErrorKind,
    wire_text,
)
from cni_agent.cni.args import PodMeta
from cni_agent.cni.tracectx import TRACE_ENV, parse_trace_context
from cni_agent.readiness.monitor import Monitor, NetworkState
from cni_agent.readiness.podcidrs import PodCIDRs
from cni_agent.sandboxes.attach import AttachRequest
from cni_agent.sandboxes.checks import Outcome
from cni_agent.sandboxes.manager import DEFAULT_IFNAME, NetworkRequest, SandboxManager, SetupRequest
from cni_agent.sandboxes.policy import METHODS, Caller, Scope, cnicall_scope
from cni_agent.service.auth import Authorizer
from cni_agent.service.callers import Callers, InFlight, cnicall, error_of, invalid
from cni_agent.service.cnicall import ShimCalls, command_of
from cni_agent.service.gate import Gate, close_all
from cni_agent.service.tracing import Tracing
from cni_agent.service.watchers import Watchers

log = logging.getLogger(__name__)


MAX_CAPABILITIES_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
MAX_WAIT = 24 * 3600.0
# The W3C trace context (TRACEPARENT, TRACESTATE, BAGGAGE: cni/tracectx.py) is
# an option of every method that runs plugins.
OPTION_KEYS = {"networks": "a(ss)", "args": "a{ss}", "pod": "a{ss}", "capabilities": "s",
               "netns_fd": "h", **dict.fromkeys(TRACE_ENV, "s")}

# Method name → the D-Bus input signature (checked before dispatch, so a wrong
# signature is InvalidArgument, not a generic UnknownMethod).
SIGNATURES = {
    "Setup": "ssa{sv}", "Teardown": "ssa{sv}", "Check": "ssa{sv}", "Show": "s",
    "ListSandboxes": "", "WaitReady": "d", "GarbageCollect": "as", "Reload": "",
    "SetPodCIDRs": "as", "Attach": "ssssa{sv}", "Detach": "ssssa{sv}", "CNICall": "a{ss}s",
    "CheckSandboxes": "as", "ResetPodCIDRs": "", "NetworkCapacity": "s",
    "WatchSandboxes": "",
}
# dbus-fast gives a signal's arguments no names; the contract's XML has them.
SIGNAL_ARGS = {"AttachmentDrifted": ("sandbox_id", "network", "ifname", "reason"),
               "AttachmentCheckChanged": ("sandbox_id", "network", "ifname", "state", "reason"),
               "SandboxChanged": ("sandbox_id", "change", "owner_uid", "attachments")}
# Attach takes Setup's options but one network: `networks` and `pod` are Setup's.
ATTACH_OPTIONS = ("args", "capabilities", "netns_fd", *TRACE_ENV)

_TRACE_KEYS = frozenset(TRACE_ENV)

F = TypeVar("F", bound=Callable[..., Any])


def signature(*params: str, returns: str = "") -> Callable[[F], F]:
    """Give dbus-fast its signature strings while the code keeps real type hints.

    dbus-fast reads D-Bus types from annotations; this works the same on
    Debian's dbus-fast 1.84 and PyPI's 5.x, and keeps mypy meaningful.
    """

    def apply(fn: F) -> F:
        names = list(inspect.signature(fn).parameters)[1:]
        annotations: dict[str, str] = dict(zip(names, params, strict=True))
        if returns:
            annotations["return"] = returns
        fn.__annotations__ = annotations
        return fn

    return apply


def _short(e: DBusError) -> str:
    """org.cniagent.Agent1.Error.NotReady -> NotReady."""
    return str(e.type).rsplit(".", 1)[-1]


def _variant(options: Mapping[str, Any], key: str) -> Any:
    v = options[key]
    expected = OPTION_KEYS[key]
    if not isinstance(v, Variant) or v.signature != expected:
        got = v.signature if isinstance(v, Variant) else type(v).__name__
        raise invalid(f"options.{key}", f"must have D-Bus type {expected}, not {got}")
    return v.value


def _depth(obj: Any) -> int:
    depth, level = 0, [obj]
    while level:
        depth += 1
        nxt: list[Any] = []
        for o in level:
            if isinstance(o, dict):
                nxt.extend(o.values())
            elif isinstance(o, list):
                nxt.extend(o)
        level = nxt
    return depth


def parse_capabilities(text: str) -> dict[str, Any]:
    if len(text.encode()) > MAX_CAPABILITIES_BYTES:
        raise invalid("options.capabilities", f"larger than {MAX_CAPABILITIES_BYTES} bytes")
    try:
        caps = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as e:
        raise invalid("options.capabilities", f"not valid JSON: {e}") from None
    if not isinstance(caps, dict):
        raise invalid("options.capabilities", "must be a JSON object")
    if _depth(caps) > MAX_JSON_DEPTH:
        raise invalid("options.capabilities", f"nested deeper than {MAX_JSON_DEPTH} levels")
    return caps


def parse_options(options: Mapping[str, Any], known: Sequence[str] = tuple(OPTION_KEYS),
                  fds: Sequence[int] = ()) -> dict[str, Any]:
    """The `a{sv}` options of Setup/Teardown/Check (or the `known` subset), checked key by key."""
    for key in options:
        if key not in known:
            raise invalid("options", f"unknown key {key!r} (known: {', '.join(known)})")
    out: dict[str, Any] = {}
    if "networks" in options:
        nets = []
        for i, (name, ifname) in enumerate(_variant(options, "networks")):
            nets.append(NetworkRequest(name, ifname or (DEFAULT_IFNAME if i == 0 else f"net{i}")))
        out["networks"] = tuple(nets)
    if "args" in options:
        out["args"] = tuple(_variant(options, "args").items())
    if "pod" in options:
        pod = dict(_variant(options, "pod"))
        unknown = set(pod) - {"namespace", "name", "uid"}
        if unknown:
            raise invalid("options.pod", f"unknown key {sorted(unknown)[0]!r} (known: namespace, name, uid)")
        if not pod.get("namespace") or not pod.get("name"):
            raise invalid("options.pod", "needs both namespace and name")
        out["pod"] = PodMeta(pod["namespace"], pod["name"], pod.get("uid", ""))
    if "capabilities" in options:
        out["capabilities"] = parse_capabilities(_variant(options, "capabilities"))
    if "netns_fd" in options:
        fd = _variant(options, "netns_fd")
        # Only a descriptor the message carried: without one dbus-fast leaves the
        # index, which would name whatever file the agent has open under it.
        if not isinstance(fd, int) or fd not in fds:
            raise invalid("options.netns_fd", "no file descriptor came with the call")
        out["netns_fd"] = fd
    if not _TRACE_KEYS.isdisjoint(options):
        out["trace"] = parse_trace_context(
            {key: _variant(options, key) for key in TRACE_ENV if key in options}, "options.")
    return out


class AgentInterface(ServiceInterface):
    def __init__(
        self,
        manager: SandboxManager,
        monitor: Monitor,
        pod_cidrs: PodCIDRs,
        authorizer: Authorizer,
        reload: Callable[[], Awaitable[None]],
        *,
        shim: ShimCalls,
        on_operation: Callable[[str, str, float], None] = lambda method, result, seconds: None,
        check_now: Callable[[list[str], Caller], Awaitable[list[dict[str, Any]]]] | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(INTERFACE)
        self.tracing = tracing or Tracing()
        for sig in ServiceInterface._get_signals(self):
            for arg, name in zip(sig.introspection.args, SIGNAL_ARGS.get(sig.name, ()),
                                 strict=False):
                arg.name = name
        self._check_now = check_now
        self.shim = shim
        # (method, "ok" or the error name, seconds from arrival to reply): metrics
        self._on_operation = on_operation
        self.manager = manager
        self.monitor = monitor
        self.pod_cidrs = pod_cidrs
        self.authorizer = authorizer
        self._reload = reload
        # Who may call, bounds, the drain's count: shared with the shim's socket.
        self.callers = Callers(authorizer)
        # The bus's message handler: descriptors and strangers' rates (gate.py).
        self.gate = Gate(authorizer, self.callers.limits, SIGNATURES, OPTION_KEYS)
        # WatchSandboxes' callers: every signal naming a sandbox goes to them alone.
        self.watchers = Watchers(manager.journal.events, manager.journal.store.read_owner)
        self.gate.on_signal = self.watchers.on_signal
        self._collecting: asyncio.TimerHandle | None = None
        self._shown = monitor.state
        pod_cidrs.subscribe(self.on_pod_cidrs)

    @property
    def in_flight(self) -> InFlight:
        return self.callers.in_flight

    # --- plumbing -------------------------------------------------------------------

    async def _serve(self, name: str, work: Callable[[Caller], Awaitable[Any]],
                     scope: Scope | None = None) -> Any:
        """Serve one call: the caller's credentials from the bus, then
        `Callers.serve` (who, whether, bounds, the drain's count) and
        `work(caller)`, its failure turned into one of the contract's errors."""
        result = "Cancelled"  # the caller left or we are stopping, unless set below
        # dbus-fast runs the handler as the message is read: this is its arrival.
        arrived = time.monotonic()
        info = self.gate.call.get()
        scope = METHODS[name] if scope is None else scope
        try:
            credentials = await self.authorizer.credentials(info.sender, name)
            value = await self.callers.serve(
                name, scope, credentials, work, sender=info.sender, counted=info.counted,
                interactive=info.interactive)
            result = "ok"
            return value
        except Exception as e:
            err = DBusError(*error_of(name, e))
            result = _short(err)
            if not info.wants_reply:  # nobody to tell (dbus-fast would log it as a crash)
                log.debug("%s (no reply expected) failed: %s", name, err.text)
                return None
            try:
                raise err from None
            finally:  # the traceback holds this frame: no cycle keeping the call's arguments
                del err, e
        finally:
            close_all(info.fds)
            if info.big:
                self._collect_soon()
            self._on_operation(name, result, time.monotonic() - arrived)

    def _traced(self, name: str, opts: Mapping[str, Any], sandbox_id: str, network: str = "",
                ifname: str = "") -> AbstractContextManager[object]:
        """Around a method's work: its trace (the caller's options, `tracing`)."""
        def attributes() -> dict[str, str]:
            found = {"cni.container_id": sandbox_id}
            if network:
                found["cni.network"] = network
            if ifname:
                found["cni.ifname"] = ifname
            return found

        return self.tracing.call(name, opts.get("trace"), attributes)

    def _collect_soon(self) -> None:
        """A huge call (anyone may send 32 MiB) is kept alive after its answer by
        the reference cycles an error's traceback makes (dbus-fast's future and
        its callback): collect them once it has been answered."""
        if self._collecting is None:
            def collect() -> None:
                self._collecting = None
                gc.collect()

            self._collecting = asyncio.get_running_loop().call_later(0.05, collect)

    def begin_shutdown(self) -> None:
        """No call waits for polkit from now on (its callers get ShuttingDown)."""
        if self.authorizer.polkit is not None:
            self.authorizer.polkit.stop()

    def on_state(self, state: NetworkState) -> None:
        """Monitor listener: announce exactly the properties that changed."""
        old, self._shown = self._shown, state
        changed: dict[str, Any] = {}
        if old.ready != state.ready:
            changed["NetworkReady"] = state.ready
        if old.status != state.status:
            changed["Status"] = wire_text(state.status)
        if old.default_network != state.default_network:
            changed["DefaultNetwork"] = state.default_network
        if old.networks != state.networks:
            changed["Networks"] = list(state.networks)
        if old.last_error != state.last_error:
            changed["LastError"] = wire_text(state.last_error)
        if not changed:
            return
        try:
            self.emit_properties_changed(changed)
        except Exception as e:
            # A send on a connection that broke before its reader noticed fails
            # inside dbus-fast's loop over the interface's buses: it finalizes
            # the bus, which unexports us mid-iteration (1.84: "Set changed size
            # during iteration"; 5.x: EBADF on the closed socket). The state is
            # kept above, so the properties read right; only the signal is lost,
            # on a connection nobody can listen on any more.
            log.info("PropertiesChanged not sent, the bus connection is gone: %s", e)

    def on_pod_cidrs(self) -> None:
        """PodCIDRs listener: a SetPodCIDRs, ResetPodCIDRs or reload changed them."""
        try:
            self.emit_properties_changed({"PodCIDRs": list(self.pod_cidrs.cidrs),
                                          "PodCIDRsSource": self.pod_cidrs.source})
        except Exception as e:  # as for on_state: the connection is gone
            log.info("PropertiesChanged not sent, the bus connection is gone: %s", e)

    def on_check(self, outcome: Outcome) -> None:
        """Checks listener: AttachmentDrifted and AttachmentCheckChanged, unicast
        to the watchers that may Show the sandbox (watchers.py; broadcast
        before 0.2.0's interface revision 5)."""
        self.watchers.check(outcome)

    # The signals naming a sandbox: declared here for introspection only, never
    # sent through dbus-fast (which would broadcast them); Watchers sends each
    # to the callers of WatchSandboxes that may Show the sandbox.

    @signal()
    @signature("s", "s", "s", "s", returns="ssss")
    def AttachmentDrifted(self, sandbox_id: str, network: str, ifname: str,
                          reason: str) -> list[str]:
        raise NotImplementedError("unicast by Watchers.check")

    @signal()
    @signature("s", "s", "s", "s", "s", returns="sssss")
    def AttachmentCheckChanged(self, sandbox_id: str, network: str, ifname: str, state: str,
                               reason: str) -> list[str]:
        raise NotImplementedError("unicast by Watchers.check")

    @signal()
    @signature("s", "s", "u", "a(ssssas)", returns="ssua(ssssas)")
    def SandboxChanged(self, sandbox_id: str, change: str, owner_uid: int,
                       attachments: list[Any]) -> list[Any]:
        raise NotImplementedError("unicast by Watchers.publish")

    # --- properties -------------------------------------------------------------------

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="b")
    def NetworkReady(self) -> bool:
        return self._shown.ready

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="s")
    def Status(self) -> str:
        return wire_text(self._shown.status)

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="s")
    def DefaultNetwork(self) -> str:
        return self._shown.default_network

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="as")
    def Networks(self) -> list[str]:
        return list(self._shown.networks)

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="s")
    def LastError(self) -> str:
        return wire_text(self._shown.last_error)

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="as")
    def PodCIDRs(self) -> list[str]:
        return list(self.pod_cidrs.cidrs)

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="s")
    def PodCIDRsSource(self) -> str:
        return self.pod_cidrs.source

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="s")
    def Version(self) -> str:
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    @signature(returns="u")
    def InterfaceRevision(self) -> int:
        return INTERFACE_REVISION

    # --- methods ------------------------------------------------------------------------

    @method()
    @signature("s", "s", "a{sv}", returns="s")
    async def Setup(self, sandbox_id: str, netns: str, options: dict[str, Variant]) -> str:
        async def work(caller: Caller) -> str:
            opts = parse_options(options, fds=self.gate.call.get().fds)
            req = SetupRequest(sandbox_id, netns, opts.get("networks", ()), opts.get("args", ()),
                               opts.get("pod"), opts.get("capabilities", {}),
                               netns_fd=opts.get("netns_fd"), caller=caller)
            with self._traced("Setup", opts, sandbox_id):
                return json.dumps(await self.manager.setup(req))

        result: str = await self._serve("Setup", work)
        return result

    @method()
    @signature("s", "s", "a{sv}")
    async def Teardown(self, sandbox_id: str, netns: str, options: dict[str, Variant]) -> None:
        async def work(caller: Caller) -> None:
            opts = parse_options(options, fds=self.gate.call.get().fds)
            with self._traced("Teardown", opts, sandbox_id):
                await self.manager.teardown(sandbox_id, netns, caller, opts.get("netns_fd"))

        await self._serve("Teardown", work)

    @method()
    @signature("s", "s", "a{sv}")
    async def Check(self, sandbox_id: str, netns: str, options: dict[str, Variant]) -> None:
        async def work(caller: Caller) -> None:
            opts = parse_options(options, fds=self.gate.call.get().fds)
            with self._traced("Check", opts, sandbox_id):
                await self.manager.check(sandbox_id, netns, caller, opts.get("netns_fd"))

        await self._serve("Check", work)

    @method()
    @signature("s", returns="s")
    async def Show(self, sandbox_id: str) -> str:
        async def work(caller: Caller) -> str:
            return json.dumps(await self.manager.show(sandbox_id, caller))

        result: str = await self._serve("Show", work)
        return result

    @method()
    @signature(returns="as")
    async def ListSandboxes(self) -> list[str]:
        result: list[str] = await self._serve("ListSandboxes", self.manager.list)
        return result

    @method()
    @signature("d", returns="b")
    async def WaitReady(self, timeout_seconds: float) -> bool:
        async def work(caller: Caller) -> bool:
            if not math.isfinite(timeout_seconds) or timeout_seconds < 0:
                raise invalid("timeout_seconds", "must be a non-negative number of seconds")
            return await self.monitor.wait_ready(min(timeout_seconds, MAX_WAIT))

        result: bool = await self._serve("WaitReady", work)
        return result

    @method()
    @signature("s", returns="s")
    async def NetworkCapacity(self, network: str) -> str:
        async def work(caller: Caller) -> str:
            return json.dumps(await self.manager.network_capacity(network, caller))

        # Open to all, like the properties: how full a pool is, never whose.
        result: str = await self._serve("NetworkCapacity", work)
        return result

    @method()
    @signature("as")
    async def GarbageCollect(self, valid_sandbox_ids: list[str]) -> None:
        async def work(caller: Caller) -> None:
            await self.manager.garbage_collect(valid_sandbox_ids, caller)

        await self._serve("GarbageCollect", work)

    @method()
    @signature()
    async def Reload(self) -> None:
        await self._serve("Reload", lambda caller: self._reload())

    @method()
    @signature("as")
    async def SetPodCIDRs(self, cidrs: list[str]) -> None:
        async def work(caller: Caller) -> None:
            await self.pod_cidrs.set(cidrs)  # its listener announces a change

        await self._serve("SetPodCIDRs", work)

    @method()
    @signature()
    async def ResetPodCIDRs(self) -> None:
        async def work(caller: Caller) -> None:
            await self.pod_cidrs.reset()

        await self._serve("ResetPodCIDRs", work)

    @method()
    @signature("as", returns="s")
    async def CheckSandboxes(self, sandbox_ids: list[str]) -> str:
        async def work(caller: Caller) -> str:
            if self._check_now is None:
                raise AgentError(ErrorKind.NOT_FOUND, "checks are not available")
            found = await self._check_now(list(sandbox_ids), caller)
            return json.dumps({"attachments": found})

        result: str = await self._serve("CheckSandboxes", work)
        return result

    @method()
    @signature()
    async def WatchSandboxes(self) -> None:
        async def work(caller: Caller) -> None:
            await self.watchers.add(self.gate.call.get().sender, caller)

        await self._serve("WatchSandboxes", work)

    @method()
    @signature("s", "s", "s", "s", "a{sv}", returns="s")
    async def Attach(self, sandbox_id: str, netns: str, network: str, ifname: str,
                     options: dict[str, Variant]) -> str:
        async def work(caller: Caller) -> str:
            opts = parse_options(options, ATTACH_OPTIONS, self.gate.call.get().fds)
            req = AttachRequest(sandbox_id, netns, network, ifname or DEFAULT_IFNAME,
                                opts.get("args", ()), opts.get("capabilities", {}),
                                netns_fd=opts.get("netns_fd"), caller=caller)
            with self._traced("Attach", opts, sandbox_id, network, ifname):
                return json.dumps(await self.shim.attachments.attach(req))

        result: str = await self._serve("Attach", work)
        return result

    @method()
    @signature("s", "s", "s", "s", "a{sv}")
    async def Detach(self, sandbox_id: str, netns: str, network: str, ifname: str,
                     options: dict[str, Variant]) -> None:
        async def work(caller: Caller) -> None:
            opts = parse_options(options, ATTACH_OPTIONS, self.gate.call.get().fds)
            with self._traced("Detach", opts, sandbox_id, network, ifname):
                await self.shim.attachments.detach(sandbox_id, netns, network,
                                                   ifname or DEFAULT_IFNAME, caller=caller,
                                                   netns_fd=opts.get("netns_fd"))

        await self._serve("Detach", work)

    @method()
    @signature("a{ss}", "s", returns="us")
    async def CNICall(self, environment: dict[str, str], config: str) -> list[Any]:
        async def work(caller: Caller) -> list[Any]:
            return list(await cnicall(self.shim, caller, environment, config))

        # STATUS and VERSION change nothing: open to all, like NetworkReady;
        # the others name a namespace by path: root's (a runtime's) alone.
        result: list[Any] = await self._serve("CNICall", work,
                                              cnicall_scope(command_of(environment)))
        return result
