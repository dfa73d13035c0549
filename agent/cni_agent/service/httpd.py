"""Opt-in HTTP face for Prometheus and probes (`http.listen`): /healthz, /readyz, /metrics.

Served by aiohttp on the daemon's event loop, so /healthz answering at all
proves the loop is alive. /readyz follows the monitor's public state, which
turns not-ready at the first instant of shutdown (the same transition as the
NetworkReady property and STOPPING=1), while D-Bus calls are still served.

`http.web_config` adds TLS and basic auth (webconfig.py reads the file;
basicauth.py checks the users). The listening socket is made here rather
than by an aiohttp site, so that a reload can put a new TLS context in
place: a context cannot drop a CA it has loaded, and changing what a
listener's handshakes require means a new listener on the same address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from cni_agent.config import parse_listen
from cni_agent.readiness.monitor import Monitor
from cni_agent.sandboxes.capacity import Capacities
from cni_agent.sandboxes.records import Phase
from cni_agent.sandboxes.store import SandboxStore
from cni_agent.service.basicauth import BasicAuth
from cni_agent.service.metrics import Metrics
from cni_agent.webconfig import WebConfig

log = logging.getLogger(__name__)


class ListenError(Exception):
    """`http.listen` cannot be served; the message is one line for the user."""


# The challenge a client without (good) credentials gets with its 401.
CHALLENGE = 'Basic realm="cni-agent", charset="UTF-8"'
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HealthServer:
    def __init__(self, listen: str, monitor: Monitor, metrics: Metrics, store: SandboxStore,
                 bus_alive: Callable[[], bool], web_config: WebConfig | None = None,
                 capacities: Capacities | None = None) -> None:
        self.listen = listen
        self._capacities = capacities
        self._monitor = monitor
        self._metrics = metrics
        self._store = store
        self._bus_alive = bus_alive
        self._web = web_config or WebConfig("")
        self._auth = BasicAuth(self._web.users) if self._web.users else None
        app = web.Application(middlewares=[self._authenticate])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_page)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._listener: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        await self._runner.setup()
        try:
            self._listener = await self._listen(self._web)
        except OSError as e:
            await self._runner.cleanup()
            raise ListenError(f"http.listen {self.listen}: {e.strerror or e}") from None
        log.info("serving /healthz, /readyz and /metrics on %s (%s)", self.listen, _what(self._web))
        self._warn_if_clear(self._web)

    def _warn_if_clear(self, config: WebConfig) -> None:
        """Passwords in the clear, where someone else could read them."""
        where = parse_listen(self.listen)
        if config.users and config.tls is None and not isinstance(where, str) \
                and where[0] not in ("127.0.0.1", "::1", "localhost"):
            log.warning("http.web_config has basic_auth_users but no tls_server_config: "
                        "passwords cross the network to %s in the clear", self.listen)

    async def _listen(self, config: WebConfig) -> asyncio.AbstractServer:
        where = parse_listen(self.listen)
        connection = self._runner.server  # aiohttp's protocol factory
        assert connection is not None  # set up in start()
        loop = asyncio.get_running_loop()
        if isinstance(where, str):
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(where).st_mode):
                    os.unlink(where)  # left by a killed agent, or our own old listener's
            listener = await loop.create_unix_server(connection, where, ssl=config.tls)
        else:
            listener = await loop.create_server(connection, where[0], where[1], ssl=config.tls,
                                                reuse_address=True)
        return listener

    async def reconfigure(self, config: WebConfig) -> None:
        """A reload's web config, already read and checked: the users at once;
        a changed TLS context by a new listener on the same address."""
        old = self._web
        self._web = config
        self._auth = BasicAuth(config.users) if config.users else None
        self._warn_if_clear(config)
        if self._listener is not None and config.tls_fingerprint == old.tls_fingerprint \
                and (config.tls is None) == (old.tls is None):
            log.info("http.web_config: %s", _what(config))
            return
        # Stop accepting, then listen again at once: a connection attempt in
        # between is refused (Prometheus tries again at its next scrape). The
        # connections open now are all the old listener's: they are closed, so
        # that none goes on under the settings just replaced. (No listener: the
        # last attempt failed, and this reload tries again.)
        if self._listener is not None:
            self._listener.close()
        server = self._runner.server
        previous = server.connections if server is not None else []
        try:
            self._listener = await self._listen(config)
        except OSError as e:
            self._listener = None
            log.error("http.listen %s: cannot listen again with the new TLS settings: %s; "
                      "/metrics is not served until a reload or restart succeeds", self.listen,
                      e.strerror or e)
            return
        for handler in list(previous):
            handler.close()  # after the request it is serving, if any
        log.info("http.web_config: %s (listening again)", _what(config))

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._runner.cleanup()

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        auth = self._auth
        if auth is not None and not await auth.allowed(request.headers.get("Authorization")):
            return web.Response(status=401, text="401 Unauthorized\n",
                                headers={"WWW-Authenticate": CHALLENGE})
        return await handler(request)

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


def _what(config: WebConfig) -> str:
    """How the listener is guarded, for the log."""
    parts = ["TLS" if config.tls is not None else "no TLS"]
    parts.append(f"basic auth ({len(config.users)} user(s))" if config.users else "no authentication")
    return ", ".join(parts)
