"""Networks' address capacity, read when asked: never on a call's path.

`cni.pool` says what a network's pool is and reads host-local's data dir;
this runs that read off the event loop (a data dir is a path in the
admin's config, and may sit on a slow or hung mount), bounded in time, one
read per network at a time (callers asking meanwhile share it), and keeps
the last answer so a caller may accept one a little old (a stranger's, at
most `STRANGER_MAX_AGE`). Asked by `NetworkCapacity`, `/metrics` at scrape
time, and a failed ADD for its "the pool is full" hint; nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.pool import CapacityPlan, CapacityState, capacity_plan, pool_full, read_capacity

READ_TIMEOUT = 5.0  # seconds one caller waits for a data dir
STRANGER_MAX_AGE = 1.0  # seconds: how old an answer to a caller neither root nor a member may be

_Key = tuple[str, bytes]


class Capacities:
    def __init__(self, timeout: float = READ_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._reading: dict[_Key, asyncio.Future[dict[str, Any]]] = {}
        self._last: dict[_Key, tuple[float, dict[str, Any]]] = {}

    async def of(self, net: NetworkConfigList, max_age: float = 0.0) -> dict[str, Any]:
        """`net`'s capacity document (`cni.pool.read_capacity`): one read no
        older than `max_age` seconds, or one under way; "unknown" with the
        reason when the data dir does not answer within `timeout`."""
        plan = capacity_plan(net)
        if plan.state is not CapacityState.KNOWN:
            return read_capacity(plan)  # no disk: the config alone says it
        key = (net.name, net.bytes)
        last = self._last.get(key)
        if last is not None and max_age > 0 and self._clock() - last[0] <= max_age:
            return last[1]
        reading = self._reading.get(key)
        if reading is None:
            reading = self._reading[key] = self._start(key, plan)
        try:
            return await asyncio.wait_for(asyncio.shield(reading), self.timeout)
        except TimeoutError:
            dirs = ", ".join(p.data_dir for p in plan.pools)
            return plan.unknown(f"host-local's data dir {dirs} did not answer within "
                                f"{self.timeout:g}s")

    async def full(self, net: NetworkConfigList) -> str:
        """The words for a failed ADD when `net`'s pool is known to be full, else ""."""
        try:
            return pool_full(await self.of(net))
        except Exception:  # a hint, never a second failure
            return ""

    def _start(self, key: _Key, plan: CapacityPlan) -> asyncio.Future[dict[str, Any]]:
        """The read, on a daemon thread of its own (a data dir on a hung mount
        holds that thread, never the agent's exit); one per network at a time."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        started = self._clock()

        def deliver(doc: dict[str, Any] | None, error: BaseException | None) -> None:
            self._reading.pop(key, None)
            if error is not None:
                if not fut.done():
                    fut.set_exception(error)
                return
            assert doc is not None
            # Only the newest config's reading is kept (a reload makes new keys).
            for old in [k for k in self._last if k[0] == key[0] and k != key]:
                del self._last[old]
            self._last[key] = (started, doc)
            if not fut.done():
                fut.set_result(doc)

        def read() -> None:
            doc: dict[str, Any] | None = None
            error: BaseException | None = None
            try:
                doc = read_capacity(plan)
            except Exception as e:  # to the callers, as the agent's own error
                error = e
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody asks any more
                loop.call_soon_threadsafe(deliver, doc, error)

        threading.Thread(target=read, name="cni-agent-capacity", daemon=True).start()
        return fut

    def forget(self, names: set[str]) -> None:
        """Drop what is kept for networks that are no longer loaded."""
        for key in [k for k in self._last if k[0] not in names]:
            del self._last[key]
