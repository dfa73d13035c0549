"""Spans over OTLP/HTTP with the OpenTelemetry SDK: imported only when
`tracing.otlp_endpoint` is set (service/tracing.py), never otherwise.

A span per call (SERVER, a child of the caller's traceparent: `cni-agent
Setup`, `cni-agent CNICall ADD`, …) and a child span per plugin execution
(CLIENT, `ADD bridge`, with the verb, plugin, network, interface and result
code; its duration is the span's). Ending a span only queues it: the SDK's
BatchSpanProcessor exports from a thread of its own, so the event loop never
waits for the collector (a full queue drops spans, it never blocks). At
shutdown the queue is flushed, off the loop and bounded.

The provider is the agent's own, never the global one: nothing else in the
process exports through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from cni_agent import __version__
from cni_agent.cni.tracectx import TraceContext

# Seconds one export may take (the collector's answer), and the shutdown's
# flush in all: a stop must not wait long for a collector that is away.
EXPORT_TIMEOUT = 5.0
CLOSE_TIMEOUT = 5.0


def _hex(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


class PluginSpan:
    __slots__ = ("_span", "span_id")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        sc = span.get_span_context()
        # "" for the SDK's invalid span (OTEL_SDK_DISABLED): the plugin then
        # names the call's parent, never a zero id.
        self.span_id = _hex(sc.span_id, 16) if sc.is_valid else ""

    def end(self, code: int, error: str) -> None:
        span = self._span
        span.set_attribute("cni.result_code", code)
        if code:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


class CallSpans:
    """A call's span, and its plugins' spans under it."""

    __slots__ = ("_context", "_span", "_tracer")

    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span
        self._context = trace.set_span_in_context(span, Context())

    def plugin(self, verb: str, plugin: str, network: str, ifname: str) -> PluginSpan:
        attributes = {"cni.command": verb, "cni.plugin": plugin, "cni.network": network}
        if ifname:
            attributes["cni.ifname"] = ifname
        return PluginSpan(self._tracer.start_span(f"{verb} {plugin}", context=self._context,
                                                  kind=SpanKind.CLIENT, attributes=attributes))

    def end(self, error: BaseException | None) -> None:
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
        self._span.end()


class Exporter:
    def __init__(self, url: str) -> None:
        self.url = url
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": "cni-agent", "service.version": __version__}),
            shutdown_on_exit=False)
        self._provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT)))
        self._tracer = self._provider.get_tracer("cni_agent", __version__)

    def call(self, name: str, parent: TraceContext | None,
             attributes: Mapping[str, str]) -> tuple[CallSpans, TraceContext | None]:
        """The call's span, a child of `parent` (the caller's span, remote), and
        the context its plugins descend from: the caller's tracestate and
        baggage, this span as the parent (`parent` itself when the SDK made no
        valid span: OTEL_SDK_DISABLED)."""
        context = Context()
        if parent is not None:
            remote = trace.SpanContext(
                int(parent.trace_id, 16), int(parent.parent_id, 16), is_remote=True,
                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if parent.sampled
                                             else trace.TraceFlags.DEFAULT),
                trace_state=_trace_state(parent.tracestate))
            context = trace.set_span_in_context(trace.NonRecordingSpan(remote), context)
        span = self._tracer.start_span(f"cni-agent {name}", context=context,
                                       kind=SpanKind.SERVER, attributes=dict(attributes))
        sc = span.get_span_context()
        if not sc.is_valid:
            return CallSpans(self._tracer, span), parent
        own = TraceContext(_hex(sc.trace_id, 32), _hex(sc.span_id, 16), sc.trace_flags.sampled,
                           parent.tracestate if parent else "", parent.baggage if parent else "")
        return CallSpans(self._tracer, span), own

    async def close(self) -> None:
        """Flush and stop the exporter's thread, in a daemon thread of its own
        (a collector that never answers must not keep the process alive)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shut() -> None:
            try:
                self._provider.force_flush(int(CLOSE_TIMEOUT * 1000))
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(finished)

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        threading.Thread(target=shut, name="cni-agent-otlp-close", daemon=True).start()
        try:
            await asyncio.wait_for(done, CLOSE_TIMEOUT + 1)
        except TimeoutError:
            pass


def _trace_state(text: str) -> trace.TraceState | None:
    if not text:
        return None
    try:
        return trace.TraceState.from_header([text])
    except ValueError:
        return None
