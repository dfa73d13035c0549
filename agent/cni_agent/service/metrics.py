"""The agent's Prometheus metrics: one registry per agent, fed by the core's seams.

Every series is a plain number here; prometheus_client (with the http.server,
email and urllib it imports: ~30 ms of every start) is imported only when the
registry is first read, by a scrape: an agent without `http.listen` never does.

Nothing here is a second source of truth: readiness is read from the
monitor's state at scrape time, sandboxes from the record store; the
counters move where the work happens (the D-Bus methods, the one plugin
execution path, the sandbox locks, the reaper).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

from cni_agent.api import ErrorKind
from cni_agent.cni.errors import (
    CODE_DECODE_FAILURE,
    CODE_INCOMPATIBLE_VERSION,
    CODE_INVALID_CONFIG,
    CODE_INVALID_ENV,
    CODE_NOT_AVAILABLE,
    CODE_TRY_AGAIN_LATER,
    CODE_UNKNOWN_CONTAINER,
    ExecError,
    PluginError,
    PluginTimeout,
)
from cni_agent.cni.exec import Executor, Invocation
from cni_agent.readiness.monitor import Monitor, NetworkState
from cni_agent.readiness.reasons import REASONS
from cni_agent.sandboxes.checks import Outcome
from cni_agent.service.cnicall import CODE_INTERNAL, PLUGIN, Answer

# Plugin runs take from 1 ms (no-op) to minutes (dhcp, a remote IPAM).
_PLUGIN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_LOCK_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60)
# A call: from a read-only property-like answer (< 1 ms) to a Setup that waits
# for readiness, a lock and a chain (minutes).
_OPERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                      30, 60, 120, 300)
# The CNI codes the agent itself answers through the shim (cnicall.py), each
# counted from 0 so an alert's increase() sees the first one.
_SHIM_CODES = (CODE_INCOMPATIBLE_VERSION, CODE_UNKNOWN_CONTAINER, CODE_INVALID_ENV,
               CODE_DECODE_FAILURE, CODE_INVALID_CONFIG, CODE_TRY_AGAIN_LATER, CODE_NOT_AVAILABLE,
               CODE_INTERNAL)
_STATE_ERROR = str(ErrorKind.STATE_ERROR)
# Answers about a plugin's run, not the agent's own: its CNI error passed on,
# or its run failing (a timeout, an exec error: code 999 with the agent's
# words). cni_agent_plugin_executions_total counts those, and alerts on them.
_PLUGINS = frozenset({PLUGIN, str(ErrorKind.PLUGIN_FAILED), str(ErrorKind.TIMEOUT)})
# What the agent did with a DEL the shim queued while it was down (service/queued.py).
QUEUED_OUTCOMES = ("done", "gone", "stale", "failed", "refused")


def plugin_result(e: BaseException | None) -> str:
    """A small, fixed set of label values: ok, a CNI error code, or how it broke."""
    if e is None:
        return "ok"
    if isinstance(e, PluginError):
        return f"code_{e.code}"
    if isinstance(e, PluginTimeout):
        return "timeout"
    if isinstance(e, ExecError):
        return type(e).__name__
    return "error"


class Metrics:
    def __init__(self) -> None:
        # Every series a plain number (`_Counts`, `_Times`, `_Levels`), read only
        # when scraped: prometheus_client's own take a lock, and a Python loop
        # over the buckets, at each update, and its import costs every start.
        self._hot = hot = _Hot()
        self._registry: CollectorRegistry | None = None
        self.operations = hot.counts(
            "cni_agent_operations", "D-Bus method calls by method and result (ok or the error name)",
            ("method", "result"))
        self.operation_seconds = hot.times(
            "cni_agent_operation_duration_seconds",
            "Wall time of one D-Bus method call, from its arrival to its reply, by method",
            ("method",), _OPERATION_BUCKETS)
        self.plugin_runs = hot.counts(
            "cni_agent_plugin_executions", "Plugin executions by plugin, verb and result",
            ("plugin", "verb", "result"))
        self.plugin_seconds = hot.times(
            "cni_agent_plugin_duration_seconds", "Wall time of one plugin execution",
            ("plugin", "verb"), _PLUGIN_BUCKETS)
        self.transitions = hot.counts("cni_agent_readiness_transitions", "Changes of NetworkReady")
        self.ready = hot.levels("cni_agent_network_ready", "NetworkReady (1 ready, 0 not)")
        self.network_ready = hot.levels(
            "cni_agent_network_status_ready",
            "Per loaded network: 1 when its plugins answer STATUS, else 0", ("network",))
        self.invalid = hot.levels("cni_agent_invalid_networks", "Configuration files refused")
        self.reaped = hot.counts(
            "cni_agent_gc_attachments", "Attachments removed by recovery and GC, by how",
            ("how",))
        self.lock_wait = hot.times(
            "cni_agent_lock_wait_seconds", "Time waited for a sandbox lock", (), _LOCK_BUCKETS)
        self.busy = hot.counts("cni_agent_busy_refusals",
                               "Requests refused Busy (a sandbox or network lock not free in time)")
        self.sandboxes = hot.levels("cni_agent_sandboxes", "Sandboxes with attachments")
        self.shim_calls = hot.counts(
            "cni_agent_shim_calls", "CNI calls forwarded by cni-agent-shim, by command and result "
            "(ok or the CNI error code)", ("command", "result"))
        self.checks = hot.counts(
            "cni_agent_checks", "CHECKs of attachments by result: ok, failed (the plugin's "
            "CHECK failed after a pass: drift), unsupported (never passed), disabled (the "
            "network allows none), failed_to_run (a timeout, a plugin that could not start, "
            "the agent's own error: no verdict, never repaired)", ("result",))
        self.drift = hot.counts(
            "cni_agent_drift", "Attachments whose CHECK passed and then failed, by network",
            ("network",))
        self.repairs = hot.counts(
            "cni_agent_repairs", "Repairs of drifted attachments (check.repair), by result: ok, "
            "unverified (its new CHECK fails), new_address (re-created with another address), "
            "refused (it would change the address), failed (its re-ADD failed: lost), "
            "retry_ok and retry_failed (a lost attachment ADDed again)", ("result",))
        self.lost = hot.levels(
            "cni_agent_attachments_lost",
            "Attachments a failed repair left lost (kept in their record, ADDed again with "
            "backoff until that succeeds or the sandbox is torn down)")
        self.tearing_down = hot.levels(
            "cni_agent_sandboxes_tearing_down",
            "Sandboxes with an attachment whose removal has not finished (Show's state "
            "tearing-down): a failed Teardown keeps it until one succeeds")
        self.reaping_passes = hot.counts(
            "cni_agent_reaping_passes", "Periodic reaping passes (gc.interval), by whether they "
            "removed any attachment (freed: yes or no)", ("freed",))
        self.shim_seconds = hot.times(
            "cni_agent_shim_call_duration_seconds",
            "Wall time of one CNI call forwarded by cni-agent-shim, by command",
            ("command",), _OPERATION_BUCKETS)
        self.shim_errors = hot.counts(
            "cni_agent_shim_errors",
            "CNI errors the agent itself answered through cni-agent-shim, by CNI code (a "
            "plugin's failure, its code passed on or its run timed out or broken, is counted "
            "in cni_agent_plugin_executions_total instead)",
            ("code",))
        for code in _SHIM_CODES:
            self.shim_errors.touch((str(code),))
        self.state_errors = hot.counts(
            "cni_agent_state_errors",
            "Calls answered StateError (the agent's own disk refused: full, read-only, "
            "unreadable), on D-Bus and through cni-agent-shim (code 11 there)")
        # One series per reason, always there: 1 for the current one, 0 for the
        # others (all 0 when ready), as a state set is exported: `== 1` selects
        # it, and the others are at 0 for an alert's changes() or absent().
        self.not_ready_reason = hot.levels(
            "cni_agent_not_ready_reason",
            "Why NetworkReady is false: 1 for the current reason, 0 for the others (all 0 "
            "when ready)", ("reason",))
        self.ipam_addresses = hot.levels(
            "cni_agent_ipam_addresses",
            "Addresses of each host-local range of each network, by state: size (the "
            "range's addresses host-local can lease), used (leased now), free; read at "
            "scrape time; no series where the capacity is not known", ("network", "range", "state"))
        self.ipam_used_ratio = hot.levels(
            "cni_agent_ipam_pool_used_ratio",
            "Per network of known capacity: used/size of the range set with the fewest free "
            "addresses (each attachment takes one address of every range set): 1 is full",
            ("network",))
        self.queued_teardowns = hot.counts(
            "cni_agent_queued_teardowns", "DELs cni-agent-shim queued while no agent ran, by "
            "what the agent did with them: done (run), gone (nothing of their sandbox's "
            "generation left), stale (the sandbox set up again since: dropped), failed (kept, "
            "run again at the next start), refused (not root's, unreadable, or a request refused as "
            "such: set aside)",
            ("outcome",))
        for outcome in QUEUED_OUTCOMES:
            self.queued_teardowns.touch((outcome,))
        self._last_ready: bool | None = None
        for how in ("deleted", "rolled_back"):
            self.reaped.touch((how,))
        for result in ("ok", "failed", "unsupported", "disabled", "failed_to_run"):
            self.checks.touch((result,))
        # Counters an alert takes increase() of exist from the start: a series
        # born at 1 would hide its first event.
        for result in ("ok", "unverified", "new_address", "refused", "failed", "retry_ok",
                       "retry_failed"):
            self.repairs.touch((result,))
        for freed in ("yes", "no"):
            self.reaping_passes.touch((freed,))

    # --- seams ---------------------------------------------------------------

    def on_state(self, state: NetworkState) -> None:
        """Monitor listener."""
        if self._last_ready is not None and state.ready != self._last_ready:
            self.transitions.inc(())
        self._last_ready = state.ready
        self.ready.set((), 1 if state.ready else 0)

    def operation(self, method: str, result: str, seconds: float | None = None) -> None:
        self.operations.inc((method, result))
        if result == _STATE_ERROR:
            self.state_errors.inc(())
        if seconds is not None:
            self.operation_seconds.observe((method,), seconds)

    def shim_call(self, command: str, answer: Answer, seconds: float | None = None) -> None:
        code = answer.code
        self.shim_calls.inc((command, "ok" if code == 0 else f"code_{code}"))
        if code and answer.kind not in _PLUGINS:
            self.shim_errors.inc((str(code),))
        if answer.kind == _STATE_ERROR:
            self.state_errors.inc(())
        if seconds is not None:
            self.shim_seconds.observe((command,), seconds)

    def queued_teardown(self, outcome: str) -> None:
        self.queued_teardowns.inc((outcome,))

    def plugin_run(self, plugin: str, verb: str, result: str, seconds: float) -> None:
        """One plugin execution: its time and its outcome."""
        self.plugin_seconds.observe((plugin, verb), seconds)
        self.plugin_runs.inc((plugin, verb, result))

    def locked(self, waited: float, busy: bool) -> None:
        self.lock_wait.observe((), waited)
        if busy:
            self.busy.inc(())

    def check(self, outcome: Outcome) -> None:
        """Checks listener: one CHECK of one attachment, or one repair."""
        if outcome.repair:
            self.repairs.inc((outcome.repair,))
            return
        self.checks.inc((outcome.result,))
        if outcome.drifted:
            self.drift.inc((outcome.network,))

    def reaping_pass(self, freed: bool) -> None:
        self.reaping_passes.inc(("yes" if freed else "no",))

    def gc_report(self, deleted: int, rolled_back: int) -> None:
        self.reaped.inc(("deleted",), deleted)
        self.reaped.inc(("rolled_back",), rolled_back)

    def observe(self, executor: Executor) -> Executor:
        """The executor, with every execution counted and timed."""
        return _MeteredExecutor(executor, self)

    # --- scrape --------------------------------------------------------------

    def refresh(self, monitor: Monitor, sandboxes: int, tearing_down: int = 0,
                lost: int = 0) -> None:
        """Gauges read from their owners, just before a scrape."""
        state = monitor.state
        failing = dict(state.network_errors)
        self.network_ready.clear()
        for name in state.networks:
            ok = name not in failing and (name != state.default_network or monitor.healthy)
            self.network_ready.set((name,), 1 if ok else 0)
            self.drift.touch((name,))  # at 0 until its first drift
        self.invalid.set((), len(state.invalid))
        for reason in REASONS:
            self.not_ready_reason.set((reason,), 1 if reason == state.reason else 0)
        self.sandboxes.set((), sandboxes)
        self.tearing_down.set((), tearing_down)
        self.lost.set((), lost)

    def capacity(self, docs: Sequence[Mapping[str, Any]]) -> None:
        """The networks' capacity documents (`cni.pool.read_capacity`), just
        before a scrape: a series per range of known capacity, nothing else."""
        self.ipam_addresses.clear()
        self.ipam_used_ratio.clear()
        for doc in docs:
            if doc.get("capacity") != "known":
                continue
            name = str(doc["network"])
            for rs in doc["range_sets"]:
                for rng in rs["ranges"]:
                    for state in ("size", "used", "free"):
                        self.ipam_addresses.set((name, rng["range"], state), rng[state])
            self.ipam_used_ratio.set((name,), doc["used"] / doc["size"] if doc["size"] else 0)

    @property
    def registry(self) -> CollectorRegistry:
        """The registry a scrape reads: these series, and the agent's own CPU,
        memory and descriptors (process_*) as the default registry has them.
        Made (prometheus_client imported) on first use."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry, ProcessCollector

            self._registry = CollectorRegistry(auto_describe=True)
            self._registry.register(self._hot)
            ProcessCollector(registry=self._registry)
        return self._registry

    def exposition(self) -> bytes:
        # No `*_created` series (a timestamp per counter and histogram child that
        # nobody alerts on, nearly doubling the page): the families are made
        # here, without them.
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _MeteredExecutor:
    """Every execution counted and timed, in `Metrics.plugin_run`'s series."""

    def __init__(self, inner: Executor, metrics: Metrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        self._m = metrics
        self._clock = clock

    def find(self, plugin: str, dirs: Sequence[str], verb: str) -> str:
        return self._inner.find(plugin, dirs, verb)

    async def execute(self, plugin: str, binary: str, inv: Invocation, stdin: bytes,
                      timeout: float) -> bytes:
        start = self._clock()
        try:
            out = await self._inner.execute(plugin, binary, inv, stdin, timeout)
        except BaseException as e:
            self._m.plugin_run(plugin, inv.command, plugin_result(e), self._clock() - start)
            raise
        self._m.plugin_run(plugin, inv.command, "ok", self._clock() - start)
        return out


class _Counts:
    """A counter's series by label values, as plain numbers."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount

    def touch(self, key: tuple[str, ...]) -> None:
        """The series exists from now on, at 0 (an alert's increase() needs it)."""
        self.values.setdefault(key, 0.0)

    def family(self) -> Metric:
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in sorted(self.values.items()):
            fam.add_metric(list(key), value)
        return fam


class _Times:
    """A histogram's series by label values: each a count per bucket (not
    cumulative) and the sum, as plain numbers."""

    def __init__(self, name: str, doc: str, labels: Sequence[str],
                 buckets: Sequence[float]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.bounds = [float(b) for b in buckets]
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts = self.series.get(key)
        if counts is None:
            counts = self.series[key] = [0.0] * (len(self.bounds) + 2)  # + the +Inf one, the sum
        counts[bisect.bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def touch(self, key: tuple[str, ...]) -> None:
        self.series.setdefault(key, [0.0] * (len(self.bounds) + 2))

    def family(self) -> Metric:
        from prometheus_client.core import HistogramMetricFamily

        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, counts in sorted(self.series.items()):
            total, buckets = 0.0, []
            for bound, n in zip([*self.bounds, math.inf], counts[:-1], strict=True):
                total += n
                buckets.append(("+Inf" if bound == math.inf else repr(bound), total))
            fam.add_metric(list(key), buckets, counts[-1])
        return fam


class _Levels:
    """A gauge's series by label values, as plain numbers."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, key: tuple[str, ...], value: float) -> None:
        self.values[key] = value

    def clear(self) -> None:
        """Every series gone (those still there are set again before a scrape)."""
        self.values.clear()

    def family(self) -> Metric:
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in sorted(self.values.items()):
            fam.add_metric(list(key), value)
        return fam


class _Hot:
    """The collector of the `_Counts`, `_Times` and `_Levels` series; one
    without labels is there from the start, at 0 (as prometheus_client's is)."""

    def __init__(self) -> None:
        self._all: list[_Counts | _Times | _Levels] = []

    def counts(self, name: str, doc: str, labels: Sequence[str] = ()) -> _Counts:
        self._all.append(series := _Counts(name, doc, labels))
        if not labels:
            series.touch(())
        return series

    def levels(self, name: str, doc: str, labels: Sequence[str] = ()) -> _Levels:
        self._all.append(series := _Levels(name, doc, labels))
        if not labels:
            series.set((), 0.0)
        return series

    def times(self, name: str, doc: str, labels: Sequence[str],
              buckets: Sequence[float]) -> _Times:
        self._all.append(series := _Times(name, doc, labels, buckets))
        if not labels:
            series.touch(())
        return series

    def collect(self) -> Iterator[Metric]:
        for series in self._all:
            yield series.family()
