"""Network readiness: a state machine fed by STATUS polls and file events.

NetworkReady is true exactly when the default network is valid and its
STATUS succeeds. Phase 1 polls every `startup_interval` until the first
success, phase 2 every `interval`, forever; file events (config or plugin
binary changed) re-read the disk at once (`scan.py`). Each network's STATUS
runs in its own task (`polls.py`), and the verdict is decided again from what
is known whenever the disk is re-read or any network answers: one network's
STATUS never delays another's verdict, and a file event never waits for one.
Readers never wait on a plugin: the state is an immutable snapshot replaced
after each decision, and no lock is held across an exec.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from cni_agent.cni.config import InvalidNetwork, NetworkConfigList
from cni_agent.cni.runtime import CNIRuntime
from cni_agent.node.watch import DirWatcher
from cni_agent.readiness.polls import Polls
from cni_agent.readiness.reasons import (
    INTERNAL_ERROR,
    NOT_CHECKED,
    SHUTTING_DOWN,
    STATUS_FAILED,
)
from cni_agent.readiness.scan import Scan, read_disk

log = logging.getLogger(__name__)

Listener = Callable[["NetworkState"], None]


@dataclass(frozen=True)
class NetworkState:
    ready: bool
    status: str
    default_network: str = ""
    networks: tuple[str, ...] = ()
    last_error: str = ""
    invalid: tuple[InvalidNetwork, ...] = ()
    # STATUS failures of networks other than the default (informational).
    network_errors: tuple[tuple[str, str], ...] = field(default=())
    # Why not ready, as one of reasons.REASONS ("" when ready): last_error's
    # words vary, this does not (a metric's label).
    reason: str = ""


STARTING = NetworkState(False, "Starting: network not checked yet", last_error="not checked yet",
                        reason=NOT_CHECKED)
STOPPED = NetworkState(False, "Stopping: network not ready (shutting down)", last_error="shutting down",
                       reason=SHUTTING_DOWN)


@dataclass(frozen=True)
class _Verdict:
    """The last decision about the default network (not the public state, which shutdown overrides)."""

    default: str
    healthy: bool
    error: str
    reason: str = ""


class Monitor:
    def __init__(
        self,
        runtime: CNIRuntime,
        conf_dir: str,
        *,
        default_network: str = "",
        fallback: NetworkConfigList | None = None,
        startup_interval: float = 0.5,
        interval: float = 5.0,
        grace_period: float = 0.0,
        watch_dirs: tuple[str, ...] | None = None,
        on_ready: Callable[[], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.conf_dir = conf_dir
        self.pinned = default_network
        self.fallback = fallback
        self.startup_interval = startup_interval
        self.interval = interval
        self.grace_period = grace_period
        self._watch_dirs = (conf_dir, *runtime.plugin_dirs) if watch_dirs is None else watch_dirs
        self._on_ready = on_ready
        self._clock = clock

        self.state = STARTING
        # The last decision, published or not: what a drain still serves by.
        self._live = STARTING
        self._decided = asyncio.Event()
        self._networks: dict[str, NetworkConfigList] = {}
        self._default: NetworkConfigList | None = None
        self._scan: Scan | None = None
        self._verdict: _Verdict | None = None
        self._polls = Polls(runtime, self._answered)
        self._healthy = False  # the real verdict, kept while shutting down
        self._ever_ready = False
        self._failing_since: float | None = None
        self._listeners: list[Listener] = []
        self._waiters: set[asyncio.Future[bool]] = set()
        self._wake = asyncio.Event()
        self._requested = 0
        self._scanned = 0
        self._reloads: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._gc_task: asyncio.Task[None] | None = None
        self._gc_again = False
        self._watcher: DirWatcher | None = None
        self._stopped = False

    # --- what readers see (never blocks) ------------------------------------

    @property
    def ready(self) -> bool:
        return self.state.ready

    @property
    def healthy(self) -> bool:
        """Whether the default network can serve ADD, even while shutting down."""
        return self._healthy

    @property
    def stopped(self) -> bool:
        return self._stopped

    def network(self, name: str) -> NetworkConfigList | None:
        return self._networks.get(name)

    def default(self) -> NetworkConfigList | None:
        return self._default

    def networks(self) -> tuple[NetworkConfigList, ...]:
        return tuple(self._networks.values())

    def unready_reason(self, name: str = "", *, serving: bool = False) -> str:
        """Why network `name` ("" = the default) cannot serve ADD now; "" when it can.

        The answer of a runtime's STATUS through the shim: from the last
        decision and the last answers, so it never waits on a plugin.
        `serving`: the agent still serves ADDs though it is shutting down (the
        drain), so the answer is the network's own, not "shutting down".
        """
        stopping = self._stopped and not serving
        st = self._live if self._stopped and serving else self.state
        if stopping or st is STARTING or not name or name == st.default_network:
            return "" if st.ready else (st.last_error or st.status)
        if name not in self._networks:
            bad = next((b for b in st.invalid if b.name == name), None)
            if bad is not None:
                return f"network {name} is invalid: {bad.source}: {bad.reason}"
            return f"network {name} not found (valid networks: {', '.join(st.networks) or 'none'})"
        poll = self._polls.get(name)
        if poll is not None and not poll.checked:
            return f"network {name}: not checked yet"
        failure = dict(st.network_errors).get(name)
        return f"network {name}: {failure}" if failure else ""

    async def wait_decided(self, timeout: float) -> None:
        """Until the first verdict (or shutdown), at most `timeout` seconds: a
        question asked at start-up gets the answer, not "not checked yet"."""
        if self._decided.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._decided.wait()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(state)` on every change, in order; returns an unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def wait_ready(self, timeout: float | None) -> bool:
        """True as soon as ready; False on timeout or shutdown."""
        if self.state.ready:
            return True
        if self._stopped:
            return False
        # No await between the check above and registering: no lost wake-up.
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(fut)

    @property
    def waiter_count(self) -> int:
        return len(self._waiters)

    # --- lifecycle -----------------------------------------------------------

    async def start(self, watch: bool = True) -> None:
        if watch:
            self._watcher = DirWatcher(self._watch_dirs, self.trigger, self._on_watch_error)
            try:
                await self._watcher.start()
            except Exception as e:  # polling still works; say so
                self._on_watch_error(f"cannot start watching: {e}")
        self._task = asyncio.create_task(self._loop(), name="cni-agent-monitor")

    def trigger(self, reason: str = "") -> None:
        """Re-read the disk and re-poll every network as soon as possible (file event, reload)."""
        if reason:
            log.debug("re-evaluating: %s", reason)
        self._requested += 1
        self._wake.set()

    async def reload(self) -> NetworkState:
        """Re-read everything now; returns once the disk was re-read, and every
        network answered a STATUS, after this call was made."""
        self.trigger("reload requested")
        target = self._requested
        if not self._stopped and not self._round_done(target):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._reloads.append((target, fut))
            await fut
        return self.state

    def begin_shutdown(self) -> None:
        """Report not-ready at once and wake every waiter with False."""
        if self._stopped:
            return
        self._stopped = True
        self._decided.set()  # nothing more will be decided for those waiting
        self._publish(STOPPED)
        for fut in list(self._waiters):
            if not fut.done():
                fut.set_result(False)

    async def stop(self) -> None:
        """Stop polling, watching and any GC; nothing is left running."""
        self.begin_shutdown()
        tasks = [t for t in (self._task, self._gc_task) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self._polls.stop()
        if self._watcher is not None:
            await self._watcher.stop()
        self._wake_reloads()

    # --- the scan loop: the disk, and the schedule of every poll ----------------

    def _on_watch_error(self, reason: str) -> None:
        log.warning("file watching failed, falling back to polling: %s", reason)

    def _delay(self) -> float:
        delay = self.interval if self._ever_ready else self.startup_interval
        if self._watcher is not None and not self._watcher.healthy:
            delay = min(delay, 1.0)  # no events: rescan the disk more often
        if self._failing_since is not None:  # re-check when the grace period ends
            remaining = self._failing_since + self.grace_period - self._clock()
            delay = min(delay, max(remaining, 0.01))
        return delay

    async def _loop(self) -> None:
        while not self._stopped:
            self._wake.clear()
            started = self._requested
            try:
                scan = await read_disk(self.runtime, self.conf_dir, self.pinned, self.fallback)
                _log_new_invalid(self._scan, scan)
                self._scan = scan
                self._networks = {n.name: n for n in scan.networks}
                self._default = scan.default
                self._polls.reconcile(scan.networks)
                # Idle networks are polled now; one in flight is not waited for.
                self._polls.request(started)
                self._decide()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # monitoring must never stop
                log.exception("readiness evaluation failed")
                self._scan = None  # no answer may decide from a stale scan until one succeeds
                self._apply_error(f"internal error while checking the network: {e}")
            self._scanned = max(self._scanned, started)
            self._wake_reloads()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._delay()):
                    await self._wake.wait()

    def _round_done(self, target: int) -> bool:
        return self._scanned >= target and self._polls.answered(target)

    def _wake_reloads(self) -> None:
        keep = []
        for target, fut in self._reloads:
            if fut.done():
                continue
            if self._stopped or self._round_done(target):
                fut.set_result(None)
            else:
                keep.append((target, fut))
        self._reloads = keep

    # --- the verdict: from the last scan and each network's last answer ----------

    def _answered(self) -> None:
        """A network's STATUS answered: decide again at once, whatever else is in flight."""
        self._decide()
        self._wake_reloads()

    def _decide(self) -> None:
        """Decide and publish from what is known now; after every scan and every answer."""
        scan = self._scan
        if scan is None:
            return
        error, status_failure, held = scan.error, False, False
        reason = scan.reason
        default = scan.default.name if scan.default is not None else ""
        poll = self._polls.get(default) if default else None
        if poll is not None and poll.checked:
            if poll.failure is not None:
                error, status_failure = f"network {default}: {poll.failure}", True
                reason = STATUS_FAILED
        elif default:  # its STATUS has not answered yet
            if self._verdict is None:
                return  # the first verdict waits for the default's first answer
            if self._verdict.default == default:
                # Its config changed: the last verdict stands until the new STATUS answers.
                held = True
            else:
                # Another network became the default: the old one's verdict is void.
                error, reason = f"network {default}: not checked yet", NOT_CHECKED
        now = self._clock()
        if held:
            assert self._verdict is not None
            healthy, error, reason = self._verdict.healthy, self._verdict.error, self._verdict.reason
        elif not error:
            self._failing_since = None
            healthy = True
        elif status_failure and self.grace_period > 0 and self._healthy:
            # A STATUS failure must last the grace period before it counts.
            if self._failing_since is None:
                self._failing_since = now
                log.warning("default network failing, grace period %gs: %s", self.grace_period, error)
            healthy = now - self._failing_since < self.grace_period
            if not healthy:
                self._failing_since = None
        else:
            self._failing_since = None
            healthy = False
        self._verdict = _Verdict(default, healthy, "" if healthy else error, "" if healthy else reason)
        others = []
        for net in scan.networks:
            p = self._polls.get(net.name)
            if net.name != default and p is not None and p.checked and p.failure is not None:
                others.append((net.name, p.failure))
        names = tuple(n.name for n in scan.networks)
        if healthy:
            state = NetworkState(
                True, _ready_text(default, names, tuple(others), scan), default, names, "",
                scan.invalid, tuple(others),
            )
        else:
            # A refused plugin dir may be why (the error then names it already).
            error = "; ".join([error, *(_refused_note(d, why) for d, why in scan.refused_dirs
                                        if why not in error)])
            state = NetworkState(
                False, f"Network not ready: {error}", default, names, error, scan.invalid,
                tuple(others), reason,
            )
        self._set_health(healthy, state)

    def _apply_error(self, error: str) -> None:
        self._verdict = _Verdict("", False, error, INTERNAL_ERROR)
        state = NetworkState(False, f"Network not ready: {error}", "", self.state.networks, error,
                             reason=INTERNAL_ERROR)
        self._set_health(False, state)

    def _set_health(self, healthy: bool, state: NetworkState) -> None:
        became_ready = healthy and not self._healthy
        if healthy != self._healthy:
            log.info("%s", state.status)
        self._healthy = healthy
        self._live = state
        self._decided.set()
        if became_ready:
            self._ever_ready = True
        if self._stopped:
            return  # the public state stays "shutting down"
        self._publish(state)
        if became_ready:
            for fut in list(self._waiters):
                if not fut.done():
                    fut.set_result(True)
            self._start_gc()

    def _publish(self, state: NetworkState) -> None:
        if state == self.state:
            return
        self.state = state
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:
                log.exception("readiness listener failed")

    # --- GC on every transition to ready --------------------------------------

    def _start_gc(self) -> None:
        if self._on_ready is None:
            return
        if self._gc_task is not None and not self._gc_task.done():
            self._gc_again = True
            return
        self._gc_task = asyncio.create_task(self._run_gc(), name="cni-agent-gc")

    async def _run_gc(self) -> None:
        assert self._on_ready is not None
        while True:
            self._gc_again = False
            try:
                await self._on_ready()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("garbage collection failed (will retry on the next recovery)")
            if not self._gc_again or self._stopped:
                return


def _ready_text(default: str, names: tuple[str, ...], others: tuple[tuple[str, str], ...],
                scan: Scan) -> str:
    count = f"{len(names)} network{'s' if len(names) != 1 else ''}"
    text = f"Network ready: default network {default} ({count})"
    notes = [f"network {name}: {err}" for name, err in others]
    notes.extend(_refused_note(d, why) for d, why in scan.refused_dirs)
    if scan.invalid:
        first = scan.invalid[0]
        more = f" and {len(scan.invalid) - 1} more" if len(scan.invalid) > 1 else ""
        notes.append(f"invalid config {first.source}: {first.reason}{more}")
    return text + ("; " + "; ".join(notes) if notes else "")


def _refused_note(directory: str, why: str) -> str:
    return f"plugin directory {directory} not used: {why}"


def _log_new_invalid(old: Scan | None, new: Scan) -> None:
    """A network file skipped, once per cause (each scan finds it again)."""
    seen = {(b.source, b.reason) for b in old.invalid} if old is not None else set()
    for bad in new.invalid:
        if (bad.source, bad.reason) not in seen:
            log.warning("network configuration %s skipped: %s", bad.source, bad.reason)
