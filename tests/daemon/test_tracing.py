"""One trace from the runtime to the plugin: the W3C trace context a runtime
gives cni-agent-shim (libcni 1.3, containernetworking/cni#1173), or a D-Bus
caller gives as options, reaches every plugin of the call as libcni passes it;
refused when it is not W3C's, before anything runs; the call's log lines
carry its TRACE_ID; and with `tracing.otlp_endpoint` a span per call and per
plugin execution reaches a real OTLP/HTTP receiver, parented on the caller's
traceparent. The real agent, the real shim, the scripted test plugin."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent import Agent, options
from tests.support.plugins import Control
from tests.support.shim import Reply, Way, run_shim, shim_conf

pytestmark = pytest.mark.root

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
BAGGAGE = "userId=alice,serverNode=DF%2028;isProduction"
TRACE = {"TRACEPARENT": TRACEPARENT, "TRACESTATE": TRACESTATE, "BAGGAGE": BAGGAGE}


def trace_options(trace: dict[str, str], **opts: Any) -> list[str]:
    """busctl's a{sv} with the trace keys (type s) after `options(**opts)`'s."""
    base = options(**opts)
    return [str(int(base[0]) + len(trace)), *base[1:],
            *[x for k, v in trace.items() for x in (k, "s", v)]]


# No baseline CHECK after an ADD: these tests count the plugin runs of each call.
NO_CHECKS = {"check": {"interval": 0}}


def shim_of(way: Way, agent: Agent) -> Callable[..., Reply]:
    """The shim exec'd as libcni does, `way` to `agent`, with `env` added to its environment."""
    base = way.env(agent)

    def run(command: str, conf: dict[str, Any], env: dict[str, str] | None = None,
            **kw: Any) -> Reply:
        return run_shim("", command, conf, env={**base, **(env or {})}, **kw)

    return run


def runs(control: Control, command: str) -> list[dict[str, Any]]:
    return [r for r in control.records() if r["command"] == command]


def trace_lines(agent: Agent, trace_id: str) -> list[str]:
    return [line for line in agent.log().splitlines() if f"TRACE_ID={trace_id}]" in line]


def test_a_runtimes_trace_reaches_every_plugin_through_the_shim(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, way: Way,
) -> None:
    testnet(plugins=[{"type": "testplug", "control": str(control.path)},
                     {"type": "testplug", "control": str(control.path), "name": "second"}])
    agent = make_agent(**NO_CHECKS)
    shim = shim_of(way, agent)
    conf = shim_conf("pods", "testnet")
    add = shim("ADD", conf, cid="tr1", netns=netns, env=TRACE)
    assert add.rc == 0, add
    assert [r["trace"] for r in runs(control, "ADD")] == [TRACE, TRACE]
    # TRACEPARENT alone: only it is set, as libcni sets only what is present.
    alone = {"TRACEPARENT": f"00-{TRACE_ID}-{'1' * 16}-00"}
    assert shim("CHECK", conf, cid="tr1", netns=netns, env=alone).rc == 0
    assert [r["trace"] for r in runs(control, "CHECK")] == [alone, alone]
    # A call without one: none (not the last call's, not the agent's own).
    assert shim("DEL", conf, cid="tr1", netns=netns).rc == 0
    assert [r["trace"] for r in runs(control, "DEL")] == [{}, {}]
    # TRACESTATE and BAGGAGE without a TRACEPARENT: nothing, as libcni.
    assert shim("ADD", conf, cid="tr2", netns=netns,
                env={"TRACESTATE": TRACESTATE, "BAGGAGE": BAGGAGE}).rc == 0
    assert runs(control, "ADD")[-1]["trace"] == {}
    # A runtime's GC: the DELs of what it no longer lists get its trace too.
    gc = {"TRACEPARENT": f"00-{'5' * 32}-{'2' * 16}-01"}
    assert shim("GC", {**conf, "cni.dev/valid-attachments": []}, env=gc).rc == 0
    assert [(r["env"]["CNI_CONTAINERID"], r["trace"]) for r in runs(control, "DEL")][2:] == \
        [("tr2", gc), ("tr2", gc)]
    # The call's lines carry its trace id (journald's TRACE_ID= field under systemd).
    lines = trace_lines(agent, TRACE_ID)
    assert any("CNI_COMMAND=ADD PLUGIN=testplug TRACE_ID=" in line for line in lines), agent.log()
    assert not any("CNI_COMMAND=DEL" in line for line in lines)


@pytest.mark.parametrize(("name", "value"), [
    ("TRACEPARENT", f"00-{TRACE_ID.upper()}-{PARENT_ID}-01"),
    ("TRACEPARENT", f"00-{'0' * 32}-{PARENT_ID}-01"),
    ("TRACESTATE", "Congo=1"),
    ("BAGGAGE", "k=a b"),
])
def test_an_invalid_trace_context_is_refused_and_nothing_runs(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, way: Way, name: str, value: str,
) -> None:
    testnet()
    agent = make_agent(**NO_CHECKS)
    conf = shim_conf("pods", "testnet")
    reply = shim_of(way, agent)("ADD", conf, cid="bad", netns=netns, env={**TRACE, name: value})
    assert reply.rc == 1 and reply.code == 4, reply  # the spec's "invalid environment variables"
    assert reply.out["msg"].startswith(f"{name}: "), reply
    out = agent.busctl("call", "org.cniagent.Agent1", "/org/cniagent/Agent1",
                       "org.cniagent.Agent1", "Setup", "ssa{sv}", "bad", netns,
                       *trace_options({**TRACE, name: value}), check=False)
    assert out.returncode != 0
    assert f"options.{name}: " in out.stderr, out.stderr
    assert runs(control, "ADD") == [] and agent.call("ListSandboxes")[0] == []


def test_dbus_callers_pass_it_as_options_to_every_method_that_runs_plugins(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str,
) -> None:
    testnet()
    testnet("side")
    agent = make_agent(**NO_CHECKS)
    ids = {m: f"{i:030x}ab" for i, m in enumerate(
        ("Setup", "Check", "Attach", "Detach", "Teardown"), 1)}

    def trace(method: str) -> dict[str, str]:
        return {"TRACEPARENT": f"00-{ids[method]}-{PARENT_ID}-01", "BAGGAGE": f"method={method}"}

    agent.call("Setup", "ssa{sv}", "dt", netns, *trace_options(trace("Setup")))
    agent.call("Check", "ssa{sv}", "dt", netns, *trace_options(trace("Check")))
    agent.call("Attach", "ssssa{sv}", "dt", netns, "side", "net1", *trace_options(trace("Attach")))
    agent.call("Detach", "ssssa{sv}", "dt", netns, "side", "net1", *trace_options(trace("Detach")))
    agent.call("Teardown", "ssa{sv}", "dt", netns, *trace_options(trace("Teardown")))
    got = [(r["command"], r["trace"]) for r in control.records()
           if r["command"] in ("ADD", "CHECK", "DEL")]
    assert got == [("ADD", trace("Setup")), ("CHECK", trace("Check")), ("ADD", trace("Attach")),
                   ("DEL", trace("Detach")), ("DEL", trace("Teardown"))], got
    for method in ids:
        assert trace_lines(agent, ids[method]), (method, agent.log())


# --- spans over OTLP/HTTP --------------------------------------------------------------


class Collector:
    """A real OTLP/HTTP receiver: POST /v1/traces, ExportTraceServiceRequest in protobuf."""

    def __init__(self, hang: threading.Event | None = None) -> None:
        """`hang`: every request waits for it (at most a minute) before it is read."""
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[Any] = []
        self.waiting = threading.Event()  # a request arrived (and hangs)
        self.paths: list[str] = []
        lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if hang is not None:
                    outer.waiting.set()
                    hang.wait(60)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                with lock:
                    outer.paths.append(self.path)
                    for rs in request.resource_spans:
                        for ss in rs.scope_spans:
                            outer.spans.extend((rs.resource, span) for span in ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def named(self, name: str) -> list[Any]:
        return [s for _, s in self.spans if s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def otel_sdk() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (make setup installs it)")


@pytest.fixture
def collector(otel_sdk: None) -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.int_value if v.HasField("int_value") else v.string_value
    return out


def test_spans_of_a_shim_call_descend_from_the_runtimes_traceparent(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, collector: Collector, way: Way,
) -> None:
    testnet(plugins=[{"type": "testplug", "control": str(control.path)},
                     {"type": "testplug", "control": str(control.path), "name": "second"}])
    agent = make_agent(tracing={"otlp_endpoint": collector.url}, **NO_CHECKS)
    shim = shim_of(way, agent)
    conf = shim_conf("pods", "testnet")
    assert shim("ADD", conf, cid="sp1", netns=netns, env=TRACE).rc == 0
    control.set("DEL", "fail", code=11, msg="try later", only=["testplug"])
    assert shim("DEL", conf, cid="sp1", netns=netns, env=TRACE).rc == 1  # its entry kept
    control.clear("DEL")
    # Flushed on shutdown: the exporter's queue is sent before the agent exits.
    assert agent.stop() == 0
    assert set(collector.paths) == {"/v1/traces"}

    [add] = collector.named("cni-agent CNICall ADD")
    assert add.trace_id.hex() == TRACE_ID and add.parent_span_id.hex() == PARENT_ID
    assert add.kind == add.SPAN_KIND_SERVER
    assert attrs(add)["cni.container_id"] == "sp1" and attrs(add)["cni.command"] == "ADD"
    plugins = collector.named("ADD testplug")
    assert len(plugins) == 2
    for span in plugins:
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id == add.span_id
        assert attrs(span) == {"cni.command": "ADD", "cni.plugin": "testplug",
                               "cni.network": "testnet", "cni.ifname": "eth0",
                               "cni.result_code": 0}
        assert span.end_time_unix_nano > span.start_time_unix_nano
    # Each plugin's TRACEPARENT names its own span as the parent (libcni names the
    # span current when it executes a plugin); TRACESTATE and BAGGAGE as given.
    given = [r["trace"] for r in runs(control, "ADD")]
    assert [t["TRACEPARENT"] for t in given] == [f"00-{TRACE_ID}-{s.span_id.hex()}-01"
                                                 for s in sorted(plugins, key=lambda s:
                                                                 s.start_time_unix_nano)]
    assert all(t["TRACESTATE"] == TRACESTATE and t["BAGGAGE"] == BAGGAGE for t in given)
    # A failed DEL: the plugin's code on its span, the call's span an error.
    [dele] = collector.named("cni-agent CNICall DEL")
    assert dele.parent_span_id.hex() == PARENT_ID and dele.status.code == dele.status.STATUS_CODE_ERROR
    [failed] = collector.named("DEL testplug")
    assert failed.parent_span_id == dele.span_id and attrs(failed)["cni.result_code"] == 11
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    resource = {kv.key: kv.value.string_value for kv in collector.spans[0][0].attributes}
    assert resource["service.name"] == "cni-agent"


def test_spans_of_a_dbus_call_without_a_traceparent_start_a_trace(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, collector: Collector,
) -> None:
    testnet()
    agent = make_agent(tracing={"otlp_endpoint": collector.url}, **NO_CHECKS)
    agent.setup("root1", netns)
    assert agent.stop() == 0
    [setup] = collector.named("cni-agent Setup")
    assert setup.parent_span_id == b""  # a root: the caller gave none
    [plugin] = collector.named("ADD testplug")
    assert plugin.parent_span_id == setup.span_id and plugin.trace_id == setup.trace_id
    [rec] = runs(control, "ADD")
    assert rec["trace"] == {"TRACEPARENT": f"00-{setup.trace_id.hex()}-{plugin.span_id.hex()}-01"}
    assert trace_lines(agent, setup.trace_id.hex())


def test_a_collector_that_never_answers_makes_no_call_wait(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, otel_sdk: None,
) -> None:
    """The exporter runs in the SDK's thread: calls go on while it waits on a
    collector that accepts and never answers, and a stop flushes for a bounded time."""
    hang = threading.Event()
    stuck = Collector(hang)
    try:
        testnet()
        agent = make_agent(start=False, tracing={"otlp_endpoint": stuck.url}, **NO_CHECKS)
        # Export at once (not after the SDK's 5 s), so the first call's spans are in flight.
        agent.start(env={"OTEL_BSP_SCHEDULE_DELAY": "10"})
        assert agent.call("WaitReady", "d", "10")[0] is True
        agent.call("Setup", "ssa{sv}", "h0", netns, *trace_options(TRACE))
        assert stuck.waiting.wait(20), "the exporter never reached the collector"
        started = time.monotonic()
        for i in range(1, 6):
            agent.call("Setup", "ssa{sv}", f"h{i}", netns, *trace_options(TRACE))
            agent.call("Teardown", "ssa{sv}", f"h{i}", netns, "0")
        # Ten calls with their plugins: well under a second each on an idle node,
        # where one exporter's wait (its 5 s timeout) in the loop would be seconds each.
        assert time.monotonic() - started < 15, agent.log()
        assert len(runs(control, "ADD")) == 6
        started = time.monotonic()
        assert agent.stop() == 0
        assert time.monotonic() - started < 20  # the flush is bounded (5 s), not the collector's
    finally:
        hang.set()
        stuck.close()


BLOCK_OTEL = '''
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''


def test_without_the_sdk_it_says_so_and_still_passes_the_trace_on(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, tmp_path: Path,
) -> None:
    site = tmp_path / "no-otel"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_OTEL)
    testnet()
    agent = make_agent(start=False, tracing={"otlp_endpoint": "http://127.0.0.1:9/"})
    agent.start(env={"PYTHONPATH": str(site)})
    assert agent.call("WaitReady", "d", "10")[0] is True
    agent.call("Setup", "ssa{sv}", "nosdk", netns, *trace_options(TRACE))
    assert runs(control, "ADD")[0]["trace"] == TRACE
    assert "the OpenTelemetry SDK is not installed" in agent.log()
    assert trace_lines(agent, TRACE_ID)
