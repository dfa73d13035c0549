"""sd_notify: what systemd learns from us (READY, STATUS, RELOADING, STOPPING, WATCHDOG).

A thin adapter over systemd-python: a no-op when NOTIFY_SOCKET is unset
(started by hand), and never fatal when the socket is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from cni_agent.api import wire_text
from systemd import daemon  # type: ignore[attr-defined]

log = logging.getLogger(__name__)


def _line(text: str) -> str:
    """A status as one assignment: a plugin's message may hold NUL (which
    fails the whole send) or a newline (which would start another one,
    READY=1 say)."""
    return wire_text(text, 1024).replace("\n", " ")


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._watchdog: asyncio.Task[None] | None = None
        self._warned = False

    def send(self, *lines: str) -> bool:
        if not self.enabled:
            return False
        try:
            return bool(daemon.notify("\n".join(lines)))
        except OSError as e:
            if not self._warned:  # once: systemd may simply be gone
                log.warning("sd_notify failed: %s", e)
                self._warned = True
            return False

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={_line(status)}")

    def status(self, text: str) -> None:
        self.send(f"STATUS={_line(text)}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={_line(status)}")

    def watchdog_interval(self) -> float | None:
        """Half of WATCHDOG_USEC, when the watchdog is enabled for this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2_000_000
        except ValueError:
            return None

    def start_watchdog(self) -> None:
        interval = self.watchdog_interval()
        if interval is None or not self.enabled:
            return
        self._watchdog = asyncio.create_task(self._ping(interval), name="cni-agent-watchdog")

    async def _ping(self, interval: float) -> None:
        # Pinged from the event loop itself: a blocked loop stops the pings,
        # which is exactly what the watchdog is for.
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
