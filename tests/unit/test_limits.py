"""The budgets of callers that are not root (service/limits.py): each class's
share is a fair queue, the classes are apart, and root is in none."""

from __future__ import annotations

import asyncio

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.sandboxes.policy import Caller, Role
from cni_agent.service.limits import (
    BURST,
    MEMBERS_BURST,
    STRANGERS_BURST,
    Limits,
    Share,
)

ROOT = Caller(0, Role.ROOT)


def stranger(uid: int) -> Caller:
    return Caller(uid, Role.STRANGER)


async def test_waiting_calls_are_served_uid_by_uid_in_turn() -> None:
    """One uid's many calls wait behind each other, not another uid's one."""
    share = Share("them", slots=1, waiting=16, per_uid=16, per_uid_slots=1)
    served: list[str] = []
    release = asyncio.Event()

    async def call(uid: int, name: str) -> None:
        await share.enter(uid)
        served.append(name)
        await release.wait()
        share.leave(uid)

    first = asyncio.create_task(call(1, "a0"))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(call(1, f"a{i}")) for i in range(1, 5)]
    await asyncio.sleep(0)
    rest.append(asyncio.create_task(call(2, "b0")))
    await asyncio.sleep(0)
    assert served == ["a0"] and share.serving == 1
    release.set()
    await asyncio.gather(first, *rest)
    assert served == ["a0", "a1", "b0", "a2", "a3", "a4"]
    assert share.serving == 0


async def test_past_its_bounds_a_call_is_busy_naming_the_bound() -> None:
    share = Share("them", slots=2, waiting=3, per_uid=4, per_uid_slots=2)
    for _ in range(2):
        await share.enter(1)
    waiters = [asyncio.create_task(share.enter(uid)) for uid in (1, 1, 2)]
    await asyncio.sleep(0)
    with pytest.raises(AgentError) as per_uid:
        await share.enter(1)  # uid 1 holds 4: 2 served, 2 waiting
    assert per_uid.value.kind is ErrorKind.BUSY
    assert per_uid.value.message == "at most 4 calls at once per uid (for them)"
    with pytest.raises(AgentError) as together:
        await share.enter(3)
    assert together.value.message == "2 calls of them are being served and 3 wait (all uids together)"
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    share.leave(1)
    share.leave(1)
    assert share.serving == 0
    await share.enter(3)  # nothing left counted of the cancelled ones
    share.leave(3)


async def test_a_call_cancelled_while_waiting_gives_its_turn_to_the_next() -> None:
    share = Share("them", slots=1, waiting=4, per_uid=4, per_uid_slots=1)
    await share.enter(1)
    gone = asyncio.create_task(share.enter(2))
    after = asyncio.create_task(share.enter(3))
    await asyncio.sleep(0)
    gone.cancel()
    share.leave(1)  # the cancelled one is skipped: uid 3 is served
    await after
    assert share.serving == 1
    with pytest.raises(asyncio.CancelledError):
        await gone
    share.leave(3)
    assert share.serving == 0


async def test_one_uids_long_calls_never_hold_every_slot() -> None:
    """A uid holds at most `per_uid_slots` of the slots: another uid's call is
    served at once beside its long ones, and its own extra ones wait."""
    share = Share("them", slots=4, waiting=8, per_uid=8, per_uid_slots=2)
    await share.enter(1)
    await share.enter(1)
    third = asyncio.create_task(share.enter(1))
    await asyncio.sleep(0)
    assert not third.done() and share.serving == 2
    await share.enter(2)  # at once: slots are free and uid 2 holds none
    await share.enter(2)
    assert share.serving == 4 and not third.done()
    share.leave(2)  # uid 1 still at its bound: the slot stays free for others
    await asyncio.sleep(0)
    assert not third.done() and share.serving == 3
    share.leave(1)
    await third
    assert share.serving == 3
    for uid in (1, 1, 2):
        share.leave(uid)
    assert share.serving == 0


async def test_a_call_that_only_waits_holds_no_slot() -> None:
    share = Share("them", slots=1, waiting=0, per_uid=3, per_uid_slots=1)
    for _ in range(2):
        await share.enter(1, slot=False)  # WaitReady: counted per uid only
    await share.enter(2)  # the one slot is free still
    with pytest.raises(AgentError) as per_uid:
        await share.enter(1, slot=False)
        await share.enter(1, slot=False)
    assert per_uid.value.message == "at most 3 calls at once per uid (for them)"
    share.leave(2)
    for _ in range(3):
        share.leave(1, slot=False)
    assert share.serving == 0


async def test_strangers_together_cannot_spend_the_members_budget_nor_roots() -> None:
    now = [100.0]
    limits = Limits(clock=lambda: now[0])
    # Each stranger within its own burst; together past theirs.
    refused = [limits.take(stranger(1000 + i)) for i in range(int(STRANGERS_BURST) + 1)]
    assert refused[:-1] == [None] * int(STRANGERS_BURST)
    last = refused[-1]
    assert last is not None and last.kind is ErrorKind.BUSY
    assert "calls per second from all callers neither root nor in the access group together" \
        in last.message
    # Members and root: untouched by it.
    member = Caller(2000, Role.MEMBER)
    assert all(limits.take(member) is None for _ in range(int(MEMBERS_BURST)))
    over = limits.take(Caller(2001, Role.DELEGATE))  # polkit's delegates count as members
    assert over is not None and "all members of the access group and polkit's delegates" in \
        over.message
    assert all(limits.take(ROOT) is None for _ in range(10 * int(MEMBERS_BURST)))
    # Time refills them.
    now[0] += 60
    assert limits.take(stranger(1000)) is None and limits.take(member) is None


async def test_a_strangers_own_rate_comes_first() -> None:
    limits = Limits(clock=lambda: 100.0)
    assert all(limits.take(stranger(7)) is None for _ in range(int(BURST)))
    over = limits.take(stranger(7))
    assert over is not None and "calls per second from this uid" in over.message
    assert limits.take(stranger(8)) is None  # another uid: the shared budget is not spent


async def test_roots_calls_never_wait_for_a_share() -> None:
    limits = Limits()
    async with limits.share(stranger(5)):
        pass
    held = []
    for _ in range(limits.members.slots):
        cm = limits.share(Caller(2000 + len(held), Role.MEMBER))
        await cm.__aenter__()
        held.append(cm)
    waiting = asyncio.create_task(limits.members.enter(3000))
    await asyncio.sleep(0)
    assert not waiting.done()
    async with limits.share(ROOT):  # at once, the members' share full
        pass
    for cm in held:
        await cm.__aexit__(None, None, None)
    await waiting
    limits.members.leave(3000)
