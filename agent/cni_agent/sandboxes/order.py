"""The order of requests on one sandbox, decided once, at arrival.

A request takes a ticket when it arrives (after validation, before it waits
for readiness or a lock). A removal (Teardown, or DEL of one attachment)
supersedes every earlier add (Setup, ADD of an attachment it covers) that has
not started yet: that add will not run, whatever it is still waiting for.
"Started" means it holds the sandbox's lock; from then on the lock's FIFO
order puts the removal after it. So a caller that gave up on a slow Setup and
cleaned up with Teardown never finds the sandbox set up afterwards.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from cni_agent.api import AgentError, ErrorKind


class Kind(Enum):
    ADD = "add"
    REMOVE = "remove"
    OTHER = "other"  # Check: neither supersedes nor is superseded
    # A scheduled CHECK (drift.py): yields to any request on its sandbox, arriving
    # before or after it; a CHECK changes nothing, so stopping one is harmless.
    BACKGROUND = "background"


@dataclass(eq=False)
class Ticket:
    sandbox_id: str
    kind: Kind
    # The interfaces it is about; None = the whole sandbox.
    ifnames: frozenset[str] | None = None
    started: bool = False
    superseded: asyncio.Event = field(default_factory=asyncio.Event)

    def covers(self, other: Ticket) -> bool:
        if self.ifnames is None or other.ifnames is None:
            return True
        return bool(self.ifnames & other.ifnames)

    def start(self) -> None:
        """Called with the sandbox lock held; raises if a later removal came first."""
        if self.superseded.is_set():
            what = "Teardown" if self.kind is Kind.ADD else "removal"
            raise AgentError(
                ErrorKind.CANCELLED,
                f"sandbox {self.sandbox_id}: a later {what} of it arrived before this request "
                "started; nothing was set up")
        self.started = True


class Sequencer:
    def __init__(self) -> None:
        self._pending: dict[str, list[Ticket]] = {}

    def yielding(self, sandbox_id: str) -> bool:
        """Whether a scheduled CHECK is queued or running on the sandbox (it yields
        to whoever arrives next, within a plugin kill)."""
        return any(t.kind is Kind.BACKGROUND for t in self._pending.get(sandbox_id, ()))

    def pending(self, sandbox_id: str) -> int:
        return len(self._pending.get(sandbox_id, ()))

    def arrive(self, sandbox_id: str, kind: Kind,
               ifnames: frozenset[str] | None = None) -> _Arrival:
        return _Arrival(self._pending, Ticket(sandbox_id, kind, ifnames))


class _Arrival:
    """`Sequencer.arrive`'s block: a class, not @contextmanager (a generator
    and its wrapper on every call)."""

    __slots__ = ("_pending", "_queue", "_ticket")

    def __init__(self, pending: dict[str, list[Ticket]], ticket: Ticket) -> None:
        self._pending, self._ticket = pending, ticket

    def __enter__(self) -> Ticket:
        ticket, kind = self._ticket, self._ticket.kind
        self._queue = queue = self._pending.setdefault(ticket.sandbox_id, [])
        if kind is Kind.REMOVE:
            for earlier in queue:
                if earlier.kind is Kind.ADD and not earlier.started and earlier.covers(ticket):
                    earlier.superseded.set()
        for earlier in queue:
            if earlier.kind is Kind.BACKGROUND:
                earlier.superseded.set()
        if kind is Kind.BACKGROUND and queue:
            ticket.superseded.set()
        queue.append(ticket)
        return ticket

    def __exit__(self, *exc: object) -> None:
        queue = self._queue
        queue.remove(self._ticket)
        if not queue:
            del self._pending[self._ticket.sandbox_id]
