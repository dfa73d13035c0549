"""The calls' traces: their W3C context in, the plugins' variables and the
log's TRACE_ID out (`cni.tracectx`), and spans when `tracing.otlp_endpoint`
is set and the OpenTelemetry SDK is installed (`otlp`, imported only then).

Which calls are traced: Setup, Teardown, Check, Attach, Detach, and CNICall
ADD, DEL, CHECK and GC (the calls that run plugins for a caller). Off (no
endpoint) and without a caller's context, a call costs one None check here
and one in `runtime._run`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from cni_agent.cni.tracectx import CallTrace, TraceContext
from cni_agent.config import TracingConfig, tracing_sdk_missing

if TYPE_CHECKING:
    from cni_agent.service.otlp import Exporter

log = logging.getLogger(__name__)

_UNTRACED: AbstractContextManager[object] = contextlib.nullcontext()


class Tracing:
    def __init__(self, exporter: Exporter | None = None) -> None:
        self.exporter = exporter

    @classmethod
    def from_config(cls, cfg: TracingConfig) -> Tracing:
        """Spans exported only with an endpoint and the SDK: else said once, and
        traces still reach plugins and the log."""
        if not cfg.otlp_endpoint:
            return cls()
        missing = tracing_sdk_missing()
        if missing:
            log.warning("tracing.otlp_endpoint is set, but %s: no spans are exported (plugins "
                        "still get the callers' trace context, and the log their TRACE_ID)",
                        missing)
            return cls()
        from cni_agent.service.otlp import Exporter

        log.info("exporting a span per call and per plugin execution to %s",
                 cfg.traces_url())
        return cls(Exporter(cfg.traces_url()))

    def call(self, name: str, context: TraceContext | None,
             attributes: Callable[[], Mapping[str, str]] | None = None
             ) -> AbstractContextManager[object]:
        """Around one call's work: its trace (the caller's `context`; with spans,
        the call's span, a child of it, or a trace's root without one, with
        `attributes()`)."""
        if self.exporter is not None:
            spans, own = self.exporter.call(name, context, attributes() if attributes else {})
            if own is not None:
                return CallTrace(own, spans)
            spans.end(None)  # the SDK made no span (disabled) and the caller gave no context
        if context is None:
            return _UNTRACED
        return CallTrace(context)

    async def close(self) -> None:
        """Export what is left (bounded), off the loop."""
        if self.exporter is not None:
            await self.exporter.close()
