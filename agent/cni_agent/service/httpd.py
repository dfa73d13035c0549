"""Opt-in HTTP face for Prometheus and probes (`http.listen`): /healthz, /readyz, /metrics.

Served by aiohttp on the daemon's event loop, so /healthz answering at all
proves the loop is alive. /readyz follows the monitor's public state, which
turns not-ready at the first instant of shutdown (the same transition as the
NetworkReady property and STOPPING=1), while D-Bus calls are still served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from cni_agent.config import parse_listen
from cni_agent.readiness.monitor import Monitor
from cni_agent.sandboxes.capacity import Capacities
from cni_agent.sandboxes.records import Phase
from cni_agent.sandboxes.store import SandboxStore
from cni_agent.service.metrics import Metrics

log = logging.getLogger(__name__)


class ListenError(Exception):
    """`http.listen` cannot be served; the message is one line for the user."""


class HealthServer:
    def __init__(self, listen: str, monitor: Monitor, metrics: Metrics, store: SandboxStore,
                 bus_alive: Callable[[], bool], capacities: Capacities | None = None) -> None:
        self.listen = listen
        self._capacities = capacities
        self._monitor = monitor
        self._metrics = metrics
        self._store = store
        self._bus_alive = bus_alive
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_page)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)

    async def start(self) -> None:
        where = parse_listen(self.listen)
        await self._runner.setup()
        site: web.BaseSite
        if isinstance(where, str):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(where).st_mode):
                    os.unlink(where)  # left by a killed agent; nobody serves it
            site = web.UnixSite(self._runner, where)
        else:
            site = web.TCPSite(self._runner, where[0], where[1])
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ListenError(f"http.listen {self.listen}: {e.strerror or e}") from None
        log.info("serving /healthz, /readyz and /metrics on %s", self.listen)

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        if not self._bus_alive():
            return web.Response(status=503, text="the bus connection is gone\n")
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        state = self._monitor.state
        return web.Response(status=200 if state.ready else 503, text=state.status + "\n")

    async def _metrics_page(self, request: web.Request) -> web.Response:
        records, unreadable = self._store.all()
        tearing_down = sum(1 for r in records if r.phase is Phase.DELETING)
        lost = sum(1 for r in records for a in r.attachments if a.lost is not None)
        self._metrics.refresh(self._monitor, len(records) + len(unreadable), tearing_down, lost)
        if self._capacities is not None:  # read now, one read per network (shared)
            nets = self._monitor.networks()
            self._capacities.forget({n.name for n in nets})
            self._metrics.capacity(await asyncio.gather(*(self._capacities.of(n) for n in nets)))
        return web.Response(body=self._metrics.exposition(),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})
