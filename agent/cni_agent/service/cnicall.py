"""A runtime's CNI call, forwarded by `cni-agent-shim`: plugin protocol in and out.

The shim sends its CNI_* environment and stdin untouched and prints what it
gets back, so everything is decided here, where it can be tested: the request
is checked as a plugin checks it (the spec's error codes 1, 4, 6, 7), mapped
to one attachment operation, and answered as a plugin answers: an exit status
and stdout — the result in the caller's cniVersion, or a CNI error whose code
tells the runtime what to do (11: try again later; a failed plugin's own
code, msg and details, unchanged).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.config import SHIM_TYPE, SHIM_VERSIONS
from cni_agent.cni.errors import (
    CODE_DECODE_FAILURE,
    CODE_INCOMPATIBLE_VERSION,
    CODE_INVALID_CONFIG,
    CODE_INVALID_ENV,
    CODE_NOT_AVAILABLE,
    CODE_TRY_AGAIN_LATER,
    CODE_UNKNOWN_CONTAINER,
    CNIError,
    InvalidArgument,
    PluginError,
)
from cni_agent.cni.result import convert_result
from cni_agent.cni.runtime import LEGACY_ATTACHMENTS_KEY, VALID_ATTACHMENTS_KEY
from cni_agent.cni.tracectx import TraceContext, parse_trace_context
from cni_agent.readiness.monitor import Monitor
from cni_agent.sandboxes.attach import Attachments, AttachRequest
from cni_agent.sandboxes.errors import Hinted, classify
from cni_agent.service.tracing import Tracing

log = logging.getLogger(__name__)

COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION")
# Those that change nothing: anyone may ask them, like the NetworkReady property.
READ_ONLY = frozenset({"STATUS", "VERSION"})
CODE_INTERNAL = 999  # libcni's ErrInternal: the agent itself failed
MAX_CONFIG = 1024 * 1024
# CNI_* values longer than this are no real runtime's.
MAX_ENV_VALUE = 4096

# Which env variable an InvalidArgument's field came from (code 4; else 7).
_ENV_FIELDS = {"sandbox_id": "CNI_CONTAINERID", "netns": "CNI_NETNS", "ifname": "CNI_IFNAME",
               "args": "CNI_ARGS"}


# Answer.kind of a failure that is not the agent's own: a plugin's CNI error,
# passed on as it was (cni_agent_plugin_executions_total counts those).
PLUGIN = "plugin"


@dataclass(frozen=True)
class Answer:
    exit_status: int
    output: str
    code: int = 0  # the CNI error code of a failure (for metrics and logs)
    # Of a failure: PLUGIN, or the agent's error name (ErrorKind: StateError,
    # NotReady, ...; InvalidArgument for a request refused as a plugin refuses
    # it). Code 11 alone does not tell a full disk from a busy sandbox.
    kind: str = ""


class Refusal(Exception):
    """The request is not one a plugin would accept; `code` is the spec's."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details


@dataclass(frozen=True)
class ShimCall:
    command: str
    cni_version: str = "1.1.0"
    origin: str = ""  # the runtime's network name
    network: str = ""  # the agent's network; "" = its default
    container_id: str = ""
    netns: str = ""
    ifname: str = ""
    args: tuple[tuple[str, str], ...] = ()
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    valid: frozenset[tuple[str, str]] = frozenset()
    trace: TraceContext | None = None  # the runtime's TRACEPARENT, TRACESTATE, BAGGAGE


def command_of(env: Mapping[str, str]) -> str:
    return env.get("CNI_COMMAND", "")


def error_answer(code: int, msg: str, details: str = "", version: str = "1.1.0",
                 kind: str = str(ErrorKind.INVALID_ARGUMENT)) -> Answer:
    doc: dict[str, Any] = {"cniVersion": version, "code": code, "msg": msg}
    if details:
        doc["details"] = details
    return Answer(1, json.dumps(doc), code, kind)


def version_answer(version: str = "1.1.0") -> Answer:
    return Answer(0, json.dumps({"cniVersion": version,
                                 "supportedVersions": list(SHIM_VERSIONS)}))


# --- parsing ------------------------------------------------------------------------


def _env(env: Mapping[str, str], name: str, required: bool) -> str:
    value = env.get(name, "")
    if required and not value:
        raise Refusal(CODE_INVALID_ENV, f"{name} is not set")
    if len(value) > MAX_ENV_VALUE:
        raise Refusal(CODE_INVALID_ENV, f"{name} is longer than {MAX_ENV_VALUE} characters")
    return value


def parse_cni_args(text: str) -> tuple[tuple[str, str], ...]:
    """CNI_ARGS `K=V;K2=V2` as pairs, in order (checked again like Setup's args)."""
    pairs = []
    for item in filter(None, text.split(";")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise Refusal(CODE_INVALID_ENV, f"CNI_ARGS: {item[:60]!r} is not KEY=VALUE")
        pairs.append((key, value))
    return tuple(pairs)


def _valid_attachments(conf: Mapping[str, Any]) -> frozenset[tuple[str, str]]:
    """The spec's list; null or absent is the empty list: libcni marshals a Go
    nil slice as null, which is what CRI-O sends when it starts with no pods."""
    raw = conf.get(VALID_ATTACHMENTS_KEY)
    if raw is None:
        raw = conf.get(LEGACY_ATTACHMENTS_KEY)
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise Refusal(CODE_INVALID_CONFIG, f"{VALID_ATTACHMENTS_KEY} must be a list")
    out = set()
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("containerID"), str) \
                or not isinstance(item.get("ifname"), str):
            raise Refusal(CODE_INVALID_CONFIG, f"{VALID_ATTACHMENTS_KEY}: each entry needs "
                                               "string containerID and ifname")
        out.add((item["containerID"], item["ifname"]))
    return frozenset(out)


def parse_trace(env: Mapping[str, str]) -> TraceContext | None:
    """The runtime's trace context, as libcni gives a plugin: code 4 naming the
    variable when one is not W3C's."""
    try:
        return parse_trace_context(env)
    except InvalidArgument as e:
        raise Refusal(CODE_INVALID_ENV, str(e)) from None


def parse_call(env: Mapping[str, str], config: str) -> ShimCall:
    """The request as the shim received it, checked; raises Refusal."""
    command = command_of(env)
    if command not in COMMANDS:
        raise Refusal(CODE_INVALID_ENV, (f"CNI_COMMAND {command!r} is not one of "
                                         + ", ".join(COMMANDS)) if command else "CNI_COMMAND is not set")
    if len(config.encode()) > MAX_CONFIG:  # bytes, as the shim reads and cuts them
        raise Refusal(CODE_INVALID_CONFIG, f"the network configuration is larger than {MAX_CONFIG} bytes")
    try:
        conf = json.loads(config)
    except (ValueError, RecursionError) as e:
        raise Refusal(CODE_DECODE_FAILURE, f"the network configuration is not valid JSON: {e}") from None
    if not isinstance(conf, dict):
        raise Refusal(CODE_DECODE_FAILURE, "the network configuration is not a JSON object")
    version = conf.get("cniVersion")
    if version not in SHIM_VERSIONS:
        raise Refusal(CODE_INCOMPATIBLE_VERSION,
                      f"cniVersion {version!r} is not supported by {SHIM_TYPE}",
                      "supported: " + ", ".join(SHIM_VERSIONS))
    if command == "VERSION":
        return ShimCall(command, version)
    origin, network = conf.get("name"), conf.get("network", "")
    if not isinstance(origin, str) or not origin:
        raise Refusal(CODE_INVALID_CONFIG, 'the network configuration has no "name"')
    if not isinstance(network, str):
        raise Refusal(CODE_INVALID_CONFIG, '"network" must be a string (an agent network name)')
    call = ShimCall(command, version, origin, network)
    if command == "STATUS":
        return call
    if command == "GC":
        return ShimCall(command, version, origin, network, valid=_valid_attachments(conf),
                        trace=parse_trace(env))
    caps = conf.get("runtimeConfig", {})
    if not isinstance(caps, dict):
        raise Refusal(CODE_INVALID_CONFIG, '"runtimeConfig" must be a JSON object')
    if command == "ADD" and "prevResult" in conf:
        raise Refusal(CODE_INVALID_CONFIG, f"{SHIM_TYPE} must be the first plugin of its list "
                                           "(it got a prevResult)")
    return ShimCall(
        command, version, origin, network,
        container_id=_env(env, "CNI_CONTAINERID", True),
        netns=_env(env, "CNI_NETNS", command != "DEL"),
        ifname=_env(env, "CNI_IFNAME", True),
        args=parse_cni_args(_env(env, "CNI_ARGS", False)),
        capabilities=caps,
        trace=parse_trace(env),
    )


# --- answering ----------------------------------------------------------------------


def _causes(e: BaseException) -> Iterator[BaseException]:
    """`e` and what it was raised from, each once (`raise x from x` makes a loop)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__


def _plugin_error(e: BaseException) -> PluginError | None:
    return next((c for c in _causes(e) if isinstance(c, PluginError)), None)


def _invalid_argument(e: BaseException) -> InvalidArgument | None:
    return next((c for c in _causes(e) if isinstance(c, InvalidArgument)), None)


def failure_answer(call: ShimCall, e: BaseException) -> Answer:
    """The agent's error as the CNI error a runtime acts on."""
    v = call.cni_version
    inner = _plugin_error(e)
    if inner is not None:
        details = inner.details or f"from plugin {inner.plugin} ({inner.verb})"
        # The plugin's code and msg unchanged; what the agent knows besides
        # (its pool is full) after them, where runtimes log it.
        hint = next((c.hint for c in _causes(e) if isinstance(c, Hinted)), "")
        return error_answer(inner.code, inner.msg,
                            f"{details}; hint: {hint}" if hint else details, v, PLUGIN)
    err = classify(e)
    bad = _invalid_argument(e)
    if bad is not None:
        env = _ENV_FIELDS.get(bad.field)
        if env:
            return error_answer(CODE_INVALID_ENV, f"{env}: {bad.reason}", version=v)
        return error_answer(CODE_INVALID_CONFIG, err.message, version=v)
    # StateError too: the agent's own disk (full, read-only, a record that
    # cannot be read now) is a condition that passes, and an ADD refused for
    # it changed nothing, a DEL answered with it released the network (its
    # repeat is harmless): the runtime's retry is the right answer.
    if err.kind in (ErrorKind.NOT_READY, ErrorKind.BUSY, ErrorKind.SHUTTING_DOWN,
                    ErrorKind.STATE_ERROR):
        return error_answer(CODE_TRY_AGAIN_LATER, err.message, version=v, kind=err.kind)
    if err.kind is ErrorKind.NOT_FOUND:
        code = CODE_UNKNOWN_CONTAINER if call.command == "CHECK" else CODE_INVALID_CONFIG
        return error_answer(code, err.message, version=v, kind=err.kind)
    if err.kind is ErrorKind.INVALID_ARGUMENT:
        return error_answer(CODE_INVALID_CONFIG, err.message, version=v)
    return error_answer(CODE_INTERNAL, err.message, version=v, kind=err.kind)


def _attributes(call: ShimCall) -> dict[str, str]:
    """The call span's attributes (service/otlp.py)."""
    attributes = {"cni.command": call.command, "cni.runtime_network": call.origin}
    if call.network:
        attributes["cni.network"] = call.network
    if call.container_id:
        attributes.update({"cni.container_id": call.container_id, "cni.ifname": call.ifname})
    return attributes


class ShimCalls:
    """Serves `CNICall`: one method for every verb of the shim."""

    def __init__(self, attachments: Attachments, monitor: Monitor,
                 on_call: Callable[[str, Answer, float], None] = lambda command, answer, seconds: None,
                 first_verdict: float = 10.0, tracing: Tracing | None = None) -> None:
        self.attachments = attachments
        self.tracing = tracing or Tracing()
        self.monitor = monitor
        self._on_call = on_call  # (command, the answer, seconds): metrics
        # How long a STATUS at start-up waits for the first verdict (timeouts.status:
        # the default network's first STATUS is due by then).
        self._first_verdict = first_verdict

    async def handle(self, env: Mapping[str, str], config: str) -> Answer:
        start = time.monotonic()
        try:
            call = parse_call(env, config)
        except Refusal as r:
            answer = error_answer(r.code, r.msg, r.details)
        else:
            try:
                answer = await self._run(call)
            except (AgentError, CNIError) as e:
                answer = failure_answer(call, e)
        command = command_of(env)
        self._on_call(command if command in COMMANDS else "invalid", answer, time.monotonic() - start)
        return answer

    async def _run(self, call: ShimCall) -> Answer:
        if call.command == "VERSION":
            return version_answer(call.cni_version)
        if call.command == "STATUS":
            # Across a restart a runtime must not see a network outage that is
            # only ours: just started, we answer once we know; draining, we
            # answer as we still serve ADDs (by the network's last verdict).
            await self.monitor.wait_decided(self._first_verdict)
            reason = self.monitor.unready_reason(
                call.network, serving=self.attachments.accepting)
            if reason:
                return error_answer(CODE_NOT_AVAILABLE, reason, version=call.cni_version,
                                    kind=str(ErrorKind.NOT_READY))
            return Answer(0, "")
        with self.tracing.call(f"CNICall {call.command}", call.trace, lambda: _attributes(call)):
            return await self._traced(call)

    async def _traced(self, call: ShimCall) -> Answer:
        """ADD, DEL, CHECK and GC: the verbs that run plugins, within the call's trace."""
        if call.command == "GC":
            errors = await self.attachments.collect(call.origin, call.valid)
            if errors:
                return error_answer(CODE_INTERNAL, f"GC finished with {len(errors)} error(s)",
                                    "; ".join(errors[:5]), call.cni_version,
                                    str(ErrorKind.PLUGIN_FAILED))
            return Answer(0, "")
        if call.command == "DEL":
            await self.attachments.detach(call.container_id, call.netns, call.network,
                                          call.ifname, call.origin)
            return Answer(0, "")
        if call.command == "CHECK":
            await self.attachments.check(call.container_id, call.netns, call.network,
                                         call.ifname, call.origin)
            return Answer(0, "")
        doc = await self.attachments.attach(AttachRequest(
            call.container_id, call.netns, call.network, call.ifname, call.args,
            call.capabilities, call.origin))
        result = doc["attachments"][0]["result"]
        if result.get("cniVersion") != call.cni_version:
            result = convert_result(result, call.cni_version, owned=True)
        # Else as it is: validated when its plugin printed it, and cached only then.
        return Answer(0, json.dumps(result))
