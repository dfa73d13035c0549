"""`cni-agent run`: wiring the core to D-Bus, systemd and signals.

Start-up order: config → state dirs → monitor → bus name → the shim's socket
→ READY=1 (not waiting for NetworkReady: the network provider may start
minutes later). Shutdown (SIGTERM/SIGINT, the multus lesson): readiness off at
once, requests still served for `shutdown_drain` seconds (Teardown always) —
or only until nothing has been in flight and no call has come for DRAIN_QUIET
seconds —, in-flight work finished, then the shim's socket closed, the bus
name released and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import uvloop
from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag, RequestNameReply

from cni_agent.api import BUS_NAME, OBJECT_PATH, AgentError, ErrorKind
from cni_agent.bus import connect
from cni_agent.cni.exec import kill_leftovers
from cni_agent.config import AgentConfig, ConfigFileError, load_config
from cni_agent.node import delqueue
from cni_agent.node.locks import StateDirBusy, lock_state_dir
from cni_agent.readiness.monitor import NetworkState
from cni_agent.service.auth import Authorizer
from cni_agent.service.dbus_service import AgentInterface
from cni_agent.service.firewalld import FirewalldWatch
from cni_agent.service.gate import close_on_exec
from cni_agent.service.logs import set_log_level, setup_logging
from cni_agent.service.notify import Notifier
from cni_agent.service.polkit import Polkit
from cni_agent.service.reconfig import merge
from cni_agent.service.shimsock import SOCKET_NAME, ShimSocket
from cni_agent.service.wiring import build_core, instance_of, policy_of
from cni_agent.webconfig import WebConfig, read_web_config

if TYPE_CHECKING:
    from cni_agent.service.httpd import HealthServer

log = logging.getLogger(__name__)
# Seconds allowed for giving the bus name back at exit.
RELEASE_TIMEOUT = 2.0
# An idle drain ends once nothing is in flight and no call came for this long:
# a stop or restart with nobody calling need not wait the whole shutdown_drain.
DRAIN_QUIET = 1.0


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the user."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def _close_on_exec_inherited() -> None:
    """Descriptors the agent was started with (beyond 0-2) never reach a plugin.

    Python opens its own close-on-exec and the bus's gate marks those that
    arrive on messages; these are the only others.
    """
    close_on_exec(fd for fd in map(int, os.listdir("/proc/self/fd")) if fd > 2)


# glibc raises its mmap threshold to the largest block freed (up to 32 MiB):
# after one huge message (anyone may send 32 MiB through the bus), every later
# big buffer comes from the heap, and the heap rarely shrinks. A fixed
# threshold keeps big blocks mmapped, so they go back to the system when freed.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def _return_big_blocks_to_the_system() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def _prepare_dirs(cfg: AgentConfig) -> None:
    for path, mode in ((cfg.state_dir, 0o755), (cfg.runtime_dir, 0o755)):
        os.makedirs(path, mode=mode, exist_ok=True)
    for sub in ("results", "journal"):
        d = os.path.join(cfg.state_dir, sub)
        os.makedirs(d, mode=0o700, exist_ok=True)
        # Temp files of writes interrupted by a crash are garbage.
        for name in os.listdir(d):
            if name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


class Daemon:
    def __init__(self, cfg: AgentConfig, config_path: str | None = None, bus: str | None = None,
                 web_config: WebConfig | None = None) -> None:
        self.cfg = cfg
        self.web_config = web_config
        self.http: HealthServer | None = None
        # What a reload re-reads: the same files (`--config` or the layers), the same --bus.
        self._config_path = config_path
        self._bus_override = bus
        self.instance = instance_of(cfg)
        self.core = build_core(cfg)
        self.monitor = self.core.monitor
        self.reaper = self.core.reaper
        self.locks = self.core.locks
        self.pod_cidrs = self.core.pod_cidrs
        self.manager = self.core.manager
        self.notifier = Notifier()
        self._stop = asyncio.Event()
        self._signals = 0
        self._recovery: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._fatal = ""  # why the agent stops on its own (it exits 1)

    async def _recover(self) -> None:
        """Runs before any sandbox operation may (they wait for `reaper.recovered`):
        the journal replayed and the cache made to agree with it (off the loop,
        while the bus and readiness come up: READY=1 does not wait for it),
        then what a killed agent left half-done."""
        try:
            for note in await asyncio.to_thread(self.core.journal.open):
                log.warning("start-up: %s", note)
        except OSError as e:
            # Nothing can be recorded: no call may run. Stop, and say why.
            self._fatal = (f"cannot open the journal in {self.cfg.state_dir}: "
                           f"{e.strerror or e}")
            log.critical("%s", self._fatal)
            self._stop.set()
            return
        await self.core.queued.bind()
        try:
            report = await self.reaper.recover()
        except Exception:
            log.exception("start-up recovery failed; the next GC retries")
        else:
            if self.core.journal.store.compact_due:  # what was replayed, in one snapshot
                self.core.journal.store.compact_soon()
            for err in report.errors:
                log.warning("start-up recovery: %s", err)
        self.core.queued.start()
        self.reaper.start_periodic()
        self.core.drift.start()

    def _on_state(self, state: NetworkState) -> None:
        self.notifier.status(state.status)

    async def reload(self) -> None:
        """SIGHUP or Reload(): re-read the agent's config files and rescan the
        networks, telling systemd around it. A broken file changes nothing."""
        self.notifier.reloading()
        log.info("reloading configuration")
        error = ""
        try:
            cfg = await asyncio.to_thread(load_config, self._config_path)
            # Read before anything changes: a bad web config keeps all as it is.
            web = await asyncio.to_thread(read_web_config, cfg)
        except ConfigFileError as e:
            error = f"{e}; the configuration in use is kept"
            log.error("reload: %s", error)
        else:
            if self._bus_override:
                cfg = cfg.replace(bus=self._bus_override)
            self.cfg = merge(self.cfg, cfg, self._apply)
            # Re-read at every reload even when the key did not change: the
            # usual change is a renewed certificate in the same file.
            self.web_config = web
            if self.http is not None:
                await self.http.reconfigure(web or WebConfig(""))
        state = await self.monitor.reload()
        self.notifier.ready(state.status)
        if error:
            raise AgentError(ErrorKind.INVALID_ARGUMENT, error)

    def _apply(self, cfg: AgentConfig) -> None:
        """The keys a reload changes in the running agent (`reconfig.LIVE`)."""
        self.monitor.pinned = cfg.default_network
        self.monitor.startup_interval = cfg.monitor.startup_interval
        self.monitor.interval = cfg.monitor.interval
        self.monitor.grace_period = cfg.monitor.grace_period
        self.pod_cidrs.configure(cfg.pod_cidrs)
        self.manager.policy = policy_of(cfg)
        self.core.journal.guard.reprobe()  # nftables may have been installed since
        if hasattr(self, "iface"):
            self.iface.authorizer.set_groups(cfg.access.groups)
        set_log_level(cfg.log_level)

    async def _reload_quietly(self) -> None:
        with contextlib.suppress(AgentError):  # logged by reload()
            await self.reload()

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            task = asyncio.ensure_future(self._reload_quietly())
            self._tasks.add(task)  # keep a reference until done
            task.add_done_callback(self._tasks.discard)
            return
        self._signals += 1
        if self._signals == 1:
            log.info("received %s: shutting down gracefully", signal.Signals(signum).name)
            self._stop.set()
        else:
            log.warning("received %s again: still finishing %d request(s) in flight",
                        signal.Signals(signum).name, self.iface.in_flight.count
                        if hasattr(self, "iface") else 0)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # Plugins inherit it (posix_spawn takes no cwd); every configured path is absolute.
        os.chdir("/")
        _close_on_exec_inherited()
        _return_big_blocks_to_the_system()
        try:
            await asyncio.to_thread(_prepare_dirs, self.cfg)
            state_lock = lock_state_dir(self.cfg.state_dir)
        except OSError as e:
            raise StartupError(f"cannot prepare {e.filename}: {e.strerror}") from None
        except StateDirBusy as e:
            raise StartupError(str(e), exit_status=2) from None
        queue_lock = await self._hold_queue()
        try:
            return await self._start(loop)
        finally:
            if queue_lock is not None:
                os.close(queue_lock)
            os.close(state_lock)

    async def _hold_queue(self) -> int | None:
        """The DELs cni-agent-shim queued while no agent ran: their queue held
        (no shim queues from now on, until we exit) and read; they run once
        recovery is over (`queued.py`)."""
        try:
            fd = await asyncio.to_thread(delqueue.hold, self.cfg.state_dir)
        except (OSError, delqueue.QueueBusy) as e:
            log.warning("cannot hold the queue of DELs in %s: %s; what is queued there runs at "
                        "a later start", delqueue.queue_dir(self.cfg.state_dir), e)
            return None
        try:
            items = await asyncio.to_thread(delqueue.scan, self.cfg.state_dir)
        except OSError as e:
            log.warning("cannot read the queue of DELs in %s: %s; what is queued there runs at "
                        "a later start", delqueue.queue_dir(self.cfg.state_dir), e)
            items = []
        self.core.queued.load(items)
        return fd

    async def _start(self, loop: asyncio.AbstractEventLoop) -> int:
        # Nothing of an earlier run may act once we serve: its plugins are killed
        # and its lock files swept before the bus name (bus activation delivers
        # queued calls the moment we own it; they then wait for recovery).
        leftovers = await asyncio.to_thread(kill_leftovers, self.instance)
        if leftovers:
            log.warning("killed %d plugin process(es) left by an earlier run", len(leftovers))
        stale = self.locks.sweep()
        if stale:
            log.info("removed %d lock file(s) left by an earlier run", len(stale))
        try:
            bus = await connect(self.cfg.bus)
        except Exception as e:
            raise StartupError(f"cannot connect to the {self.cfg.bus} bus: {e}") from None
        try:
            return await self._serve(loop, bus)
        finally:
            bus.disconnect()

    async def _serve(self, loop: asyncio.AbstractEventLoop, bus: MessageBus) -> int:
        self.iface = AgentInterface(self.manager, self.monitor, self.pod_cidrs,
                                    Authorizer(bus, self.cfg.access.groups, Polkit(bus)), self.reload,
                                    shim=self.core.shim, on_operation=self.core.metrics.operation,
                                    check_now=self.core.drift.check_now,
                                    tracing=self.core.tracing)
        self.core.checks.subscribe(self.iface.on_check)
        self.iface.gate.send = bus.send
        self.iface.watchers.bus = bus  # WatchSandboxes' signals, unicast
        # A call held until its sender's uid is known goes the way it came in.
        self.iface.gate.dispatch = bus._process_message
        bus.add_message_handler(self.iface.gate)
        bus.export(OBJECT_PATH, self.iface)
        # systemd first: its STATUS= line never depends on the bus being there.
        self.monitor.subscribe(self._on_state)
        self.monitor.subscribe(self.iface.on_state)
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            raise StartupError(f"the bus name {BUS_NAME} is already owned: is another cni-agent running?")
        # The name is ours, so we are the one agent: the shim's socket may be too.
        self.shimsock = ShimSocket(os.path.join(self.cfg.runtime_dir, SOCKET_NAME),
                                   self.iface.callers, self.core.shim,
                                   self.core.metrics.operation)
        try:
            await self.shimsock.start()
        except OSError as e:
            log.warning("cannot listen on %s: %s; cni-agent-shim uses the bus",
                        self.shimsock.path, e.strerror or e)
        try:
            return await self._serve_http(loop, bus)
        finally:
            await self.shimsock.close()

    async def _serve_http(self, loop: asyncio.AbstractEventLoop, bus: MessageBus) -> int:
        if self.cfg.http.listen:
            # Imported only when configured: aiohttp is a third of an idle agent's memory.
            from cni_agent.service.httpd import HealthServer, ListenError

            http = HealthServer(self.cfg.http.listen, self.monitor, self.core.metrics,
                                self.core.journal.store, lambda: bus.connected, self.web_config,
                                self.manager.capacity)
            try:
                await http.start()
            except ListenError as e:
                raise StartupError(str(e)) from None
            self.http = http
        try:
            return await self._serve_named(loop, bus)
        finally:
            if self.http is not None:
                await self.http.stop()

    async def _serve_named(self, loop: asyncio.AbstractEventLoop, bus: MessageBus) -> int:
        """Serve, the bus name being ours (and the HTTP face up, if configured), until stopped."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._recovery = asyncio.create_task(self._recover(), name="cni-agent-recovery")
        # Always: with CHECK passes off, a reload still has members' filters checked.
        try:
            await FirewalldWatch(bus, self.core.drift.trigger).start()
        except Exception as e:
            log.warning("cannot watch firewalld: %s; its reloads will not trigger CHECKs", e)
        await self.monitor.start()
        self.notifier.ready(self.monitor.state.status)
        self.notifier.start_watchdog()
        log.info("cni-agent serving %s on bus %s (conf_dir %s)", BUS_NAME,
                 self.cfg.bus, self.cfg.conf_dir)
        stop = asyncio.ensure_future(self._stop.wait())
        lost = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
        await asyncio.wait({stop, lost}, return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if not stop.done():
            # Without the bus nobody can reach us: exit non-zero so systemd restarts
            # the service once the bus is back (Restart=on-failure) — unless a stop
            # was asked for meanwhile (the node shutting down stops both).
            log.error("lost the connection to the bus; finishing %d request(s) in flight, "
                      "then exiting", self.iface.in_flight.count)
            self.manager.accepting = False
            await self.iface.in_flight.wait_idle()
            await self.shimsock.close()
            await self.core.stop()
            await self.notifier.stop()
            status = 0 if self._stop.is_set() else 1
        else:
            await self._shutdown(bus, lost)
        for task in (stop, lost):
            task.cancel()
        await asyncio.gather(stop, lost, return_exceptions=True)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        return 1 if self._fatal else status

    async def _drain(self, lost: asyncio.Future[None]) -> None:
        """Serve until shutdown_drain is up, the bus is gone, or the agent is idle."""
        flight = self.iface.in_flight
        start = time.monotonic()
        deadline = start + self.cfg.shutdown_drain
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            # A drain is for callers that can still reach us: when the bus goes
            # (a node shutdown stopping it alongside us), nothing new can arrive.
            if lost.done():
                log.info("the bus went away during the drain; finishing what is in flight")
                return
            quiet_since = max(start, flight.last_activity)
            if flight.count == 0 and now - quiet_since >= DRAIN_QUIET:
                log.info("no request in flight and none for %gs: the drain ends after %.1fs",
                         DRAIN_QUIET, now - start)
                return
            # In flight: look again in a while (its end restarts the quiet time);
            # idle: when the quiet time would be up, unless a call comes meanwhile.
            wake = min(deadline, now + DRAIN_QUIET if flight.count else quiet_since + DRAIN_QUIET)
            await asyncio.wait({lost}, timeout=max(0.01, wake - now))

    async def _shutdown(self, bus: MessageBus, lost: asyncio.Future[None]) -> None:
        self.iface.begin_shutdown()
        self.manager.draining = True
        self.monitor.begin_shutdown()  # NetworkReady=false now; waiters get False
        self.notifier.stopping(self.monitor.state.status)
        if self.cfg.shutdown_drain > 0:
            log.info("serving requests for up to %gs more (shutdown_drain; less once idle "
                     "for %gs)", self.cfg.shutdown_drain, DRAIN_QUIET)
            await self._drain(lost)
        self.manager.accepting = False  # new Setups get ShuttingDown; Teardown is still served
        if self.iface.in_flight.count:
            log.info("waiting for %d request(s) in flight", self.iface.in_flight.count)
        await self.iface.in_flight.wait_idle()
        # As the bus name, the socket goes only now: until then a runtime gets the
        # same answers on both (new ADDs ShuttingDown, STATUS "shutting down").
        await self.shimsock.close()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        await self.core.stop()
        await self.notifier.stop()
        if not lost.done():
            # On a connection that broke meanwhile dbus-fast (1.84) never answers:
            # bounded, and the name goes with the connection anyway.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.release_name(BUS_NAME), RELEASE_TIMEOUT)
        log.info("cni-agent stopped")


def run(config_path: str | None, bus: str | None) -> int:
    """`cni-agent run`: the daemon in the foreground until SIGTERM; its exit status."""
    if config_path is not None:
        config_path = os.path.abspath(config_path)  # re-read on reload, after chdir("/")
    try:
        cfg = load_config(config_path)
        web = read_web_config(cfg)
    except ConfigFileError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return 2  # a usage error, as the CLI's
    if bus:
        cfg = cfg.replace(bus=bus)
    setup_logging(cfg.log_level)
    try:
        # uvloop (libuv): the loop's own share of a call (scheduling, transports,
        # timers) was the largest single cost left per call; its loop cost 5-9 %
        # less agent CPU per call than asyncio's, A/B on this path (bench.ab).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(Daemon(cfg, config_path, bus, web).run())
    except StartupError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return e.exit_status
