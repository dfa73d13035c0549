"""Budgets of the callers that are not root: how much of the agent's time
they may take, so that root's calls keep their latency however many uids flood.

Anyone on the node may read the agent's state (properties, WaitReady, the
shim's STATUS and VERSION) and members may manage their sandboxes, so either
could flood it. Two kinds of bound, per class of callers (all strangers
together; all members and polkit's delegates together) and per uid:

- a rate (token buckets over every message or request, taken synchronously
  by the bus's gate and the shim's socket before anything is served): a
  stranger's uid RATE a second, all strangers STRANGERS_RATE, all members
  MEMBERS_RATE (a member's uid has no rate of its own). A call over one is
  answered `Busy` after a delay (a tarpit: a flooder that waits for each
  answer slows down to our pace, and answering it costs us a timer, not a
  method);
- a share of the calls being served (`Share`, a fair queue per class): at
  most `slots` of the class's calls are served at once, at most
  `per_uid_slots` of them one uid's; the others wait, taken in turn uid by
  uid (one uid's many calls wait behind each other, not behind another
  uid's), at most `waiting` of them; a uid holds at most `per_uid` (served
  or waiting). Past a bound: `Busy` at once. WaitReady, which only waits,
  counts against its uid's `per_uid` but holds no slot.

Root is in neither: its calls never wait for a share and are never counted,
so they are served first, whatever the others send. The counts are per uid
whatever the number of connections, and the shim's socket and the bus share
them (two ways in are not twice the budget).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field

from cni_agent.api import AgentError, ErrorKind
from cni_agent.sandboxes.policy import Caller, Role

# A stranger's uid (as before the shared budgets).
RATE = 20.0  # calls per second, sustained
BURST = 60.0  # calls at once after a quiet while
IN_FLIGHT = 8  # calls served or waiting at once (WaitReady, STATUS at start-up, polkit)
# All strangers together: a few uids' worth, whatever their number.
STRANGERS_RATE = 40.0
STRANGERS_BURST = 120.0
STRANGERS_SLOTS = 8  # served at once
STRANGERS_WAITING = 32  # waiting for one of those
STRANGER_SLOTS = 2  # of those served at once, one uid's
# All members (and polkit's delegates) together; each member's uid.
MEMBERS_RATE = 200.0
MEMBERS_BURST = 400.0
MEMBERS_SLOTS = 16
MEMBERS_WAITING = 256
MEMBER_SLOTS = 4  # of those served at once, one uid's
MEMBER_IN_FLIGHT = 64  # a member's uid: served or waiting
TARPIT = 1.0  # seconds an over-rate call waits for its Busy
MAX_TARPIT = 1024  # delayed answers held at once, all uids: past it, answered at once
_FORGET_AFTER = 600.0  # a uid quiet this long is dropped from the table

STRANGERS = "callers neither root nor in the access group"
MEMBERS = "members of the access group and polkit's delegates"
_AT_ONCE: AbstractAsyncContextManager[None] = nullcontext()  # root's share: stateless, shared


@dataclass
class _Bucket:
    tokens: float
    at: float
    seen: float = field(default=0.0)

    def refill(self, now: float, rate: float, burst: float) -> None:
        self.tokens = min(burst, self.tokens + (now - self.at) * rate)
        self.at = self.seen = now


class Share:
    """One class's share of the calls served at once: a fair queue.

    `enter(uid)` returns once the call may be served (at once while a slot is
    free and the uid holds fewer than `per_uid_slots` of them), or raises Busy
    past a bound; `leave(uid)` ends it. Waiting calls are granted in turn uid
    by uid, each uid's in arrival order, a uid at its `per_uid_slots` passed
    over: one uid's long calls cannot hold every slot. A call that only waits
    (`slot=False`: WaitReady, which costs nothing while it waits) counts
    against its uid's `per_uid` but takes no slot.
    """

    def __init__(self, who: str, slots: int, waiting: int, per_uid: int,
                 per_uid_slots: int) -> None:
        self.who = who
        self.slots = slots
        self.waiting = waiting
        self.per_uid = per_uid
        self.per_uid_slots = per_uid_slots
        self.serving = 0
        self._held: collections.Counter[int] = collections.Counter()  # served or waiting
        self._serving: collections.Counter[int] = collections.Counter()  # slots per uid
        # uid → its waiting calls; the first uid is served next, then goes last.
        self._queues: collections.OrderedDict[int, collections.deque[asyncio.Future[None]]] = (
            collections.OrderedDict())
        self._waiting = 0

    async def enter(self, uid: int, slot: bool = True) -> None:
        if self._held[uid] >= self.per_uid:
            raise AgentError(ErrorKind.BUSY, f"at most {self.per_uid} calls at once per uid "
                                             f"(for {self.who})")
        if not slot:
            self._held[uid] += 1
            return
        # A free slot means every waiting call's uid is at its own bound (they
        # are granted as slots free): this one goes first only if it is not.
        if self.serving < self.slots and self._serving[uid] < self.per_uid_slots:
            self._serve(uid)
            self._held[uid] += 1
            return
        if self._waiting >= self.waiting:
            raise AgentError(ErrorKind.BUSY, f"{self.slots} calls of {self.who} are being served "
                                             f"and {self.waiting} wait (all uids together)")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(uid, collections.deque()).append(turn)
        self._waiting += 1
        self._held[uid] += 1
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.leave(uid)  # granted as it was cancelled: the slot goes on
            else:
                self._drop(uid, turn)
            raise

    def _serve(self, uid: int) -> None:
        self.serving += 1
        self._serving[uid] += 1

    def _drop(self, uid: int, turn: asyncio.Future[None]) -> None:
        """A waiting call that went (its caller left, the agent stops)."""
        queue = self._queues.get(uid)
        if queue is not None and turn in queue:
            queue.remove(turn)
            self._waiting -= 1
            if not queue:
                del self._queues[uid]
        self._release(uid)

    def _release(self, uid: int) -> None:
        self._held[uid] -= 1
        if self._held[uid] <= 0:
            del self._held[uid]

    def leave(self, uid: int, slot: bool = True) -> None:
        self._release(uid)
        if not slot:
            return
        self.serving -= 1
        self._serving[uid] -= 1
        if self._serving[uid] <= 0:
            del self._serving[uid]
        self._grant()

    def _grant(self) -> None:
        """Free slots to waiting calls, uid by uid in turn (those under their bound)."""
        granted = True
        while granted and self.serving < self.slots:
            granted = False
            for next_uid in list(self._queues):
                if self.serving >= self.slots:
                    return
                if self._serving[next_uid] >= self.per_uid_slots:
                    continue
                queue = self._queues[next_uid]
                while queue and queue[0].done():  # cancelled, its task not yet told
                    queue.popleft()
                    self._waiting -= 1
                if queue:
                    self._waiting -= 1
                    self._serve(next_uid)
                    queue.popleft().set_result(None)
                    granted = True
                if queue:
                    self._queues.move_to_end(next_uid)  # the other uids first
                else:
                    del self._queues[next_uid]


class Limits:
    """Every bound on callers that are not root, shared by the bus and the
    shim's socket."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}  # strangers' uids
        self._strangers = _Bucket(STRANGERS_BURST, clock())
        self._members = _Bucket(MEMBERS_BURST, clock())
        self.strangers = Share(STRANGERS, STRANGERS_SLOTS, STRANGERS_WAITING, IN_FLIGHT,
                               STRANGER_SLOTS)
        self.members = Share(MEMBERS, MEMBERS_SLOTS, MEMBERS_WAITING, MEMBER_IN_FLIGHT,
                             MEMBER_SLOTS)
        self._tarpitted = 0  # delayed answers not yet sent

    def _bucket(self, uid: int, now: float) -> _Bucket:
        b = self._buckets.get(uid)
        if b is None:
            if len(self._buckets) > 4096:  # bounded whatever the number of uids
                self._buckets = {u: x for u, x in self._buckets.items()
                                 if now - x.seen < _FORGET_AFTER}
            b = self._buckets[uid] = _Bucket(BURST, now)
        b.refill(now, RATE, BURST)
        return b

    def take(self, caller: Caller) -> AgentError | None:
        """One call of `caller` against its rates: None within them, else the
        Busy naming the one it is over (nothing taken then). Root: None."""
        if caller.role is Role.ROOT:
            return None
        now = self._clock()
        if caller.role is Role.STRANGER:
            mine, shared = self._bucket(caller.uid, now), self._strangers
            shared.refill(now, STRANGERS_RATE, STRANGERS_BURST)
            if mine.tokens < 1:
                return AgentError(ErrorKind.BUSY, f"more than {RATE:g} calls per second from "
                                                  f"this uid (for {STRANGERS})")
            if shared.tokens < 1:
                return AgentError(ErrorKind.BUSY, f"more than {STRANGERS_RATE:g} calls per "
                                                  f"second from all {STRANGERS} together")
            mine.tokens -= 1
            shared.tokens -= 1
            return None
        shared = self._members
        shared.refill(now, MEMBERS_RATE, MEMBERS_BURST)
        if shared.tokens < 1:
            return AgentError(ErrorKind.BUSY, f"more than {MEMBERS_RATE:g} calls per second "
                                              f"from all {MEMBERS} together")
        shared.tokens -= 1
        return None

    def share(self, caller: Caller, slot: bool = True) -> AbstractAsyncContextManager[None]:
        """One call of `caller` served within its class's share (root: at
        once, never counted); Busy past a bound. `slot=False`: a call that
        only waits, counted per uid but holding no slot."""
        if caller.role is Role.ROOT:
            return _AT_ONCE  # no generator and its wrapper on root's every call
        return self._share(caller, slot)

    @asynccontextmanager
    async def _share(self, caller: Caller, slot: bool) -> AsyncIterator[None]:
        share = self.strangers if caller.role is Role.STRANGER else self.members
        await share.enter(caller.uid, slot)
        try:
            yield
        finally:
            share.leave(caller.uid, slot)

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
