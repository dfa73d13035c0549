"""`cni-agent run`: wiring the core to D-Bus, systemd and signals.

Start-up order: config → state dirs → monitor → bus name → READY=1 (not
waiting for NetworkReady: the network provider may start minutes later).
Shutdown (SIGTERM/SIGINT, the multus lesson): readiness off at once, requests
still served for `shutdown_drain` seconds (Teardown always), in-flight work
finished, then the bus name released and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from dbus_fast import BusType
from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag, RequestNameReply

from cni_agent.auth import Authorizer
from cni_agent.cni.exec import ProcessExecutor, kill_leftovers
from cni_agent.cni.runtime import CNIRuntime, Timeouts
from cni_agent.config import AgentConfig
from cni_agent.dbus_service import BUS_NAME, OBJECT_PATH, AgentInterface
from cni_agent.fallback import fallback_network
from cni_agent.gc import Reaper
from cni_agent.locks import RWLock, SandboxLocks
from cni_agent.monitor import Monitor, NetworkState
from cni_agent.notify import Notifier
from cni_agent.podcidrs import PodCIDRs
from cni_agent.records import SandboxStore
from cni_agent.sandbox import SandboxManager
from cni_agent.sandbox import Timeouts as SandboxTimeouts

log = logging.getLogger(__name__)


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the user."""


async def connect(bus: str) -> MessageBus:
    if bus == "system":
        return await MessageBus(bus_type=BusType.SYSTEM).connect()
    if bus == "session":
        return await MessageBus(bus_type=BusType.SESSION).connect()
    return await MessageBus(bus_address=bus).connect()


def _prepare_dirs(cfg: AgentConfig) -> None:
    for path, mode in ((cfg.state_dir, 0o755), (cfg.runtime_dir, 0o755)):
        os.makedirs(path, mode=mode, exist_ok=True)
    for sub in ("results", "sandboxes"):
        d = os.path.join(cfg.state_dir, sub)
        os.makedirs(d, mode=0o700, exist_ok=True)
        # Temp files of writes interrupted by a crash are garbage.
        for name in os.listdir(d):
            if name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


class Daemon:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        t = cfg.timeouts
        self.instance = os.path.realpath(cfg.state_dir)
        self.runtime = CNIRuntime(
            cfg.plugin_dirs, cfg.state_dir, executor=ProcessExecutor(instance=self.instance),
            timeouts=Timeouts(add=t.add, delete=t.delete, check=t.check, status=t.status,
                              gc=t.gc, version=t.version),
        )
        self.store = SandboxStore(cfg.state_dir)
        self.gc_lock = RWLock()
        self.monitor = Monitor(
            self.runtime, cfg.conf_dir,
            default_network=cfg.default_network,
            fallback=fallback_network(cfg.state_dir) if cfg.fallback_network else None,
            startup_interval=cfg.monitor.startup_interval,
            interval=cfg.monitor.interval,
            grace_period=cfg.monitor.grace_period,
            on_ready=self._gc_on_ready,
        )
        self.reaper = Reaper(self.runtime, self.store, self.gc_lock, self.monitor.networks)
        self.pod_cidrs = PodCIDRs(cfg.state_dir, cfg.pod_cidrs)
        self.locks = SandboxLocks(os.path.join(cfg.runtime_dir, "locks"))
        self.manager = SandboxManager(
            self.runtime, self.monitor, self.store, self.locks, self.gc_lock, self.reaper,
            self.pod_cidrs, SandboxTimeouts(lock=t.lock, ready=t.ready),
        )
        self.notifier = Notifier()
        self._stop = asyncio.Event()
        self._signals = 0
        self._recovery: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    async def _gc_on_ready(self) -> None:
        await self.reaper.collect()

    async def _recover(self) -> None:
        stale = self.locks.sweep()
        if stale:
            log.info("removed %d lock file(s) left by an earlier run", len(stale))
        try:
            report = await self.reaper.recover()
        except Exception:
            log.exception("start-up recovery failed; the next GC retries")
            return
        for err in report.errors:
            log.warning("start-up recovery: %s", err)

    def _on_state(self, state: NetworkState) -> None:
        self.notifier.status(state.status)

    async def reload(self) -> None:
        """SIGHUP or Reload(): rescan configuration, telling systemd around it."""
        self.notifier.reloading()
        log.info("reloading configuration")
        state = await self.monitor.reload()
        self.notifier.ready(state.status)

    def _on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            task = asyncio.ensure_future(self.reload())
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
        if sys.version_info < (3, 12):
            # 3.11's default child watcher starts a thread per plugin process;
            # pidfds (the default from 3.12 on) need none.
            watcher = asyncio.PidfdChildWatcher()
            watcher.attach_loop(loop)
            asyncio.get_event_loop_policy().set_child_watcher(watcher)
        try:
            await asyncio.to_thread(_prepare_dirs, self.cfg)
        except OSError as e:
            raise StartupError(f"cannot prepare {e.filename}: {e.strerror}") from None
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
                                    Authorizer(bus, self.cfg.access.groups), self.reload)
        bus.add_message_handler(self.iface.message_handler)
        bus.export(OBJECT_PATH, self.iface)
        self.monitor.subscribe(self.iface.on_state)
        self.monitor.subscribe(self._on_state)
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            raise StartupError(f"the bus name {BUS_NAME} is already owned: is another cni-agent running?")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        # Before any plugin of ours runs: plugins a killed predecessor left running
        # (systemd's KillMode does this for us; a supervisor without it does not).
        leftovers = await asyncio.to_thread(kill_leftovers, self.instance)
        if leftovers:
            log.warning("killed %d plugin process(es) left by an earlier run", len(leftovers))
        self._recovery = asyncio.create_task(self._recover(), name="cni-agent-recovery")
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
            # the service once the bus is back (Restart=on-failure).
            log.error("lost the connection to the bus; exiting")
            self.manager.accepting = False
            await self.iface.in_flight.wait_idle()
            await self.monitor.stop()
            status = 1
        else:
            await self._shutdown(bus)
        for task in (stop, lost):
            task.cancel()
        await asyncio.gather(stop, lost, return_exceptions=True)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        return status

    async def _shutdown(self, bus: MessageBus) -> None:
        self.manager.draining = True
        self.monitor.begin_shutdown()  # NetworkReady=false now; waiters get False
        self.notifier.stopping(self.monitor.state.status)
        if self.cfg.shutdown_drain > 0:
            log.info("serving requests for %gs more (shutdown_drain)", self.cfg.shutdown_drain)
            await asyncio.sleep(self.cfg.shutdown_drain)
        self.manager.accepting = False  # new Setups get ShuttingDown; Teardown is still served
        if self.iface.in_flight.count:
            log.info("waiting for %d request(s) in flight", self.iface.in_flight.count)
        await self.iface.in_flight.wait_idle()
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        await self.monitor.stop()
        await self.notifier.stop()
        with contextlib.suppress(Exception):
            await bus.release_name(BUS_NAME)
        log.info("cni-agent stopped")
