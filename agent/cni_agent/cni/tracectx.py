"""The W3C trace context of one call, and how it reaches the plugins.

libcni 1.3 (containernetworking/cni#1173) passes a runtime's trace context to
every plugin it executes as `TRACEPARENT`, `TRACESTATE` and `BAGGAGE`
(OpenTelemetry's environment carriers), each set only when present, and none
of them without a valid span context. The agent does the same with the
context its caller gave it (the shim forwards those variables; D-Bus callers
pass them as options): `parse_trace_context` checks them, `CallTrace` holds
one call's, and the runtime gives each plugin of the call its variables
(`Invocation.trace`) through the one path plugins run by (`runtime._run`).

A call's trace is a contextvar, as the log's fields are (`logctx`): set
around the call's work by the service layer, read where a plugin runs and
where a line is logged (`TRACE_ID=`). A task the call started that outlives
it (a deferred CHECK) sees the call closed and carries no trace. With no
trace, `current()` is one ContextVar.get and a None check: that is all a
call without one costs.

When spans are exported (`tracing.otlp_endpoint`, service/tracing.py), a
`Spans` object is the call's span: each plugin execution is a child span,
and the plugin's TRACEPARENT names that span as its parent, as libcni names
whichever span is current when it executes a plugin.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from cni_agent.cni.errors import InvalidArgument, PluginError
from cni_agent.cni.exec import Invocation

TRACE_ENV = ("TRACEPARENT", "TRACESTATE", "BAGGAGE")

# Bounds: W3C trace-context's 32 tracestate members, W3C baggage's 64 members
# and 8192 bytes (what libcni's propagator, Go's OpenTelemetry, accepts).
MAX_TRACEPARENT = 512  # a future version's traceparent may be longer than 55
MAX_TRACESTATE = 8192
MAX_TRACESTATE_MEMBERS = 32
MAX_BAGGAGE = 8192
MAX_BAGGAGE_MEMBERS = 64

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_OWS = "[ \t]*+"  # possessive: spaces never backtrack (a hostile value costs O(n))
_KEY_CHARS = r"[a-z0-9_\-*/]"
_TRACESTATE_MEMBER = re.compile(
    rf"(?:[a-z]{_KEY_CHARS}{{0,255}}|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_BAGGAGE_VALUE = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_BAGGAGE_PROPERTY = rf"{_TOKEN}(?:{_OWS}={_OWS}{_BAGGAGE_VALUE})?"
_BAGGAGE_MEMBER = re.compile(
    rf"{_OWS}{_TOKEN}{_OWS}={_OWS}{_BAGGAGE_VALUE}(?:{_OWS};{_OWS}{_BAGGAGE_PROPERTY})*{_OWS}")


@dataclass(frozen=True)
class TraceContext:
    """A valid W3C trace context: the caller's span (or the agent's own)."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    parent_id: str  # 16 lowercase hex digits, not all zero: the span plugins descend from
    sampled: bool = True
    tracestate: str = ""
    baggage: str = ""

    @property
    def traceparent(self) -> str:
        """Version 00 with the sampled flag alone: what libcni's propagator writes."""
        return f"00-{self.trace_id}-{self.parent_id}-{'01' if self.sampled else '00'}"

    def environ(self, parent_id: str = "") -> tuple[tuple[str, str], ...]:
        """A plugin's variables: TRACEPARENT (naming `parent_id` as the parent
        span when given), TRACESTATE and BAGGAGE when not empty."""
        tp = self if not parent_id else replace(self, parent_id=parent_id)
        env = [("TRACEPARENT", tp.traceparent)]
        if self.tracestate:
            env.append(("TRACESTATE", self.tracestate))
        if self.baggage:
            env.append(("BAGGAGE", self.baggage))
        return tuple(env)


def _traceparent(text: str, field: str) -> tuple[str, str, bool]:
    if len(text) > MAX_TRACEPARENT:
        raise InvalidArgument(field, f"longer than {MAX_TRACEPARENT} characters")
    m = _TRACEPARENT.match(text)
    why = "not a W3C traceparent (VERSION-TRACEID-PARENTID-FLAGS in lowercase hex, as " \
          "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01)"
    if m is None:
        raise InvalidArgument(field, why)
    version, trace_id, parent_id, flags = m.groups()
    # Version 00 is exactly these 55 characters; a later one may add fields after a dash.
    if version == "ff" or (len(text) > 55 and (version == "00" or text[55] != "-")):
        raise InvalidArgument(field, why)
    if trace_id == "0" * 32:
        raise InvalidArgument(field, "its trace id is all zeros")
    if parent_id == "0" * 16:
        raise InvalidArgument(field, "its parent id is all zeros")
    return trace_id, parent_id, bool(int(flags, 16) & 1)


def _tracestate(text: str, field: str) -> str:
    """The tracestate as libcni's propagator writes it: its members joined by
    commas, without the spaces and empty members W3C allows around them."""
    if len(text.encode()) > MAX_TRACESTATE:
        raise InvalidArgument(field, f"longer than {MAX_TRACESTATE} bytes")
    keys: set[str] = set()
    members: list[str] = []
    for raw in text.split(","):
        member = raw.strip(" \t")
        if not member:
            continue  # W3C: empty members are allowed
        if not _TRACESTATE_MEMBER.fullmatch(member):
            raise InvalidArgument(field, f"{member[:60]!r} is not a W3C tracestate member "
                                         "(key=value: a lowercase key, printable ASCII value)")
        key = member.partition("=")[0]
        if key in keys:
            raise InvalidArgument(field, f"key {key!r} appears twice")
        keys.add(key)
        members.append(member)
    if len(keys) > MAX_TRACESTATE_MEMBERS:
        raise InvalidArgument(field, f"more than {MAX_TRACESTATE_MEMBERS} members")
    return ",".join(members)


def _baggage(text: str, field: str) -> str:
    if len(text.encode()) > MAX_BAGGAGE:
        raise InvalidArgument(field, f"longer than {MAX_BAGGAGE} bytes")
    members = text.split(",")
    if len(members) > MAX_BAGGAGE_MEMBERS:
        raise InvalidArgument(field, f"more than {MAX_BAGGAGE_MEMBERS} members")
    for member in members:
        if not _BAGGAGE_MEMBER.fullmatch(member):
            raise InvalidArgument(field, f"{member.strip()[:60]!r} is not a W3C baggage member "
                                         "(key=value[;property], the value percent-encoded)")
    return text


def parse_trace_context(values: Mapping[str, str], prefix: str = "") -> TraceContext | None:
    """The trace context in `values` (keyed TRACEPARENT, TRACESTATE, BAGGAGE;
    empty or absent: not given), each present one checked: InvalidArgument
    naming `prefix` + the variable. None without a TRACEPARENT: as libcni,
    no TRACESTATE or BAGGAGE is passed on without one (they are still checked)."""
    traceparent = values.get("TRACEPARENT", "")
    tracestate = values.get("TRACESTATE", "")
    baggage = values.get("BAGGAGE", "")
    if tracestate:
        tracestate = _tracestate(tracestate, prefix + "TRACESTATE")
    if baggage:
        _baggage(baggage, prefix + "BAGGAGE")
    if not traceparent:
        return None
    trace_id, parent_id, sampled = _traceparent(traceparent, prefix + "TRACEPARENT")
    return TraceContext(trace_id, parent_id, sampled, tracestate, baggage)


# --- one call's trace ------------------------------------------------------------------


class PluginSpan(Protocol):
    span_id: str  # 16 hex digits: the plugin's TRACEPARENT names it as the parent

    def end(self, code: int, error: str) -> None: ...


class Spans(Protocol):
    """A call's span, where its plugin executions' spans are made (service/tracing.py)."""

    def plugin(self, verb: str, plugin: str, network: str, ifname: str) -> PluginSpan: ...

    def end(self, error: BaseException | None) -> None: ...


CODE_INTERNAL = 999  # a plugin run that failed without a CNI code of its own (timed out, killed…)


def result_code(error: BaseException | None) -> int:
    """A plugin execution's result code: 0, the plugin's CNI error code, or 999."""
    if error is None:
        return 0
    return error.code if isinstance(error, PluginError) else CODE_INTERNAL


_current: contextvars.ContextVar[CallTrace | None] = contextvars.ContextVar(
    "cni_agent_call_trace", default=None)


def current() -> CallTrace | None:
    """The trace of the call this task serves, if it has one and is still open."""
    call = _current.get()
    return call if call is not None and call.open else None


class CallTrace:
    """One call's trace: the context its plugins descend from, and its span
    (`spans`) when spans are exported. A context manager: the call's work
    runs inside it."""

    __slots__ = ("_inv", "_token", "context", "open", "spans")

    def __init__(self, context: TraceContext, spans: Spans | None = None) -> None:
        self.context = context
        self.spans = spans
        self.open = False
        self._inv: tuple[Invocation, Invocation] | None = None

    @property
    def trace_id(self) -> str:
        return self.context.trace_id

    def __enter__(self) -> CallTrace:
        self.open = True
        self._token = _current.set(self)
        return self

    def __exit__(self, typ: object, error: BaseException | None, tb: object) -> None:
        self.open = False
        _current.reset(self._token)
        if self.spans is not None:
            self.spans.end(error)

    def plugin(self, inv: Invocation, plugin: str, network: str) -> PluginRun:
        """Around one plugin execution: its Invocation with the trace's variables."""
        return PluginRun(self, inv, plugin, network)

    def invocation(self, inv: Invocation) -> Invocation:
        """`inv` with the call's variables; the same object for the plugins of
        one chain (the executor then builds their environment once)."""
        if self._inv is None or self._inv[0] is not inv:
            self._inv = (inv, replace(inv, trace=self.context.environ()))
        return self._inv[1]


class PluginRun:
    """One plugin execution of a traced call: with spans, a child span of the
    call's, which the plugin's TRACEPARENT names as its parent."""

    __slots__ = ("_call", "_inv", "_network", "_plugin", "_span")

    def __init__(self, call: CallTrace, inv: Invocation, plugin: str, network: str) -> None:
        self._call, self._inv, self._plugin, self._network = call, inv, plugin, network
        self._span: PluginSpan | None = None

    def __enter__(self) -> Invocation:
        call, inv = self._call, self._inv
        if call.spans is None:
            return call.invocation(inv)
        self._span = call.spans.plugin(inv.command, self._plugin, self._network, inv.ifname)
        return replace(inv, trace=call.context.environ(self._span.span_id))

    def __exit__(self, typ: object, error: BaseException | None, tb: object) -> None:
        if self._span is not None:
            self._span.end(result_code(error), "" if error is None else str(error) or
                           type(error).__name__)
