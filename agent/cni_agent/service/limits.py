"""Bounds on callers that are neither root nor members (strangers).

Anyone on the node may read the agent's state (properties, WaitReady, the
shim's STATUS and VERSION), so anyone could flood it: each uid gets a rate
(a token bucket over every method it calls) and a number of calls in flight.
A call over the rate is answered `Busy` after a delay (a tarpit: a flooder
that waits for each answer slows down to our pace, and answering it costs us
a timer, not a method); one over the in-flight bound at once. The counts are
per uid, whatever the number of connections: a uid is known once its first
call's credentials came back (that first call of a connection is counted
after, by `Callers.serve`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from cni_agent.api import AgentError, ErrorKind

RATE = 20.0  # calls per second, sustained
BURST = 60.0  # calls at once after a quiet while
IN_FLIGHT = 8  # calls waiting at once (WaitReady, STATUS at start-up, polkit)
TARPIT = 1.0  # seconds an over-rate call waits for its Busy
MAX_TARPIT = 1024  # delayed answers held at once, all uids: past it, answered at once
_FORGET_AFTER = 600.0  # a uid quiet this long is dropped from the table


@dataclass
class _Bucket:
    tokens: float
    at: float
    in_flight: int = 0
    seen: float = field(default=0.0)


class StrangerLimits:
    def __init__(self, rate: float = RATE, burst: float = BURST, in_flight: int = IN_FLIGHT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.in_flight = in_flight
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}
        self._tarpitted = 0  # delayed answers not yet sent

    def _bucket(self, uid: int, now: float) -> _Bucket:
        b = self._buckets.get(uid)
        if b is None:
            if len(self._buckets) > 4096:  # bounded whatever the number of uids
                self._buckets = {u: x for u, x in self._buckets.items()
                                 if x.in_flight or now - x.seen < _FORGET_AFTER}
            b = self._buckets[uid] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
        b.at = b.seen = now
        return b

    def take(self, uid: int) -> bool:
        """One call of `uid` against its rate: False when over it."""
        b = self._bucket(uid, self._clock())
        if b.tokens < 1:
            return False
        b.tokens -= 1
        return True

    @contextmanager
    def flight(self, uid: int) -> Iterator[None]:
        """One call of `uid` in flight; Busy over the bound."""
        b = self._bucket(uid, self._clock())
        if b.in_flight >= self.in_flight:
            raise AgentError(ErrorKind.BUSY, f"at most {self.in_flight} calls at once per uid "
                                             "(for callers neither root nor in the access group)")
        b.in_flight += 1
        try:
            yield
        finally:
            b.in_flight -= 1

    def over_rate(self) -> AgentError:
        return AgentError(ErrorKind.BUSY, f"more than {self.rate:g} calls per second from this "
                                          "uid (for callers neither root nor in the access group)")

    def tarpit(self, answer: Callable[[], object]) -> bool:
        """Call `answer` (an over-rate call's Busy) after the tarpit's delay;
        False, and nothing scheduled, when too many wait already (answer it at
        once). Its cost is a timer, whichever transport it came by."""
        if self._tarpitted >= MAX_TARPIT:
            return False
        self._tarpitted += 1

        def fire() -> None:
            self._tarpitted -= 1
            answer()

        asyncio.get_running_loop().call_later(TARPIT, fire)
        return True
