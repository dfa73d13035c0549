"""Who is told what (service/watchers.py): each signal naming a sandbox goes
to the watchers that may Show it, by the id each knows it by; a watcher
whose name leaves the bus is dropped; the 5th of a uid is Busy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from dbus_fast import Message, MessageType

from cni_agent.api import AgentError, ErrorKind
from cni_agent.sandboxes.checks import Outcome
from cni_agent.sandboxes.events import AttachmentEvent, Change, Events, SandboxEvent, State
from cni_agent.sandboxes.policy import ROOT, Caller, Role
from cni_agent.sandboxes.records import CheckVerdict
from cni_agent.service.watchers import Watchers

MEMBER = Caller(1001, Role.MEMBER)
OTHER = Caller(1002, Role.DELEGATE)
MINE = "cni-agent.u1001.m1"


class FakeBus:
    """Sends are kept; the bus daemon's calls (AddMatch, GetNameOwner) answer
    as the names in `present` say."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.present: set[str] = set()

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    async def call(self, msg: Message) -> Message:
        msg.serial = len(self.sent) + 1000  # as the bus would number it
        if msg.member == "GetNameOwner" and msg.body[0] not in self.present:
            return Message.new_error(msg, "org.freedesktop.DBus.Error.NameHasNoOwner", "gone")
        return Message.new_method_return(msg)

    def told(self, name: str) -> list[tuple[str, list[Any]]]:
        return [(str(m.member), list(m.body)) for m in self.sent if m.destination == name]


def watchers(owners: dict[str, int]) -> tuple[Watchers, FakeBus, Events]:
    events = Events()
    w = Watchers(events, owners.get)
    bus = FakeBus()
    w.bus = bus  # type: ignore[assignment]
    return w, bus, events


async def test_each_is_told_of_what_it_may_show_by_its_own_ids() -> None:
    w, bus, events = watchers({MINE: 1001, "rootpod": 0})
    assert events.on is False  # no watcher: the lifecycle builds nothing
    bus.present |= {":1.1", ":1.2", ":1.3"}
    await w.add(":1.1", ROOT)
    await w.add(":1.2", MEMBER)
    await w.add(":1.3", OTHER)
    assert events.on is True
    att = AttachmentEvent("pods", "eth0", State.READY, "0a:58:00:00:00:02", ("10.0.0.2/24",))
    w.publish(SandboxEvent("rootpod", Change.SET_UP, 0, (att,)))
    w.publish(SandboxEvent(MINE, Change.SET_UP, 1001, (att,)))
    w.check(Outcome("rootpod", "pods", "eth0", CheckVerdict.DRIFTED, "rule gone", drifted=True))
    w.check(Outcome(MINE, "pods", "eth0", CheckVerdict.DRIFTED, "rule gone", drifted=True))
    row = [["pods", "eth0", "ready", "0a:58:00:00:00:02", ["10.0.0.2/24"]]]
    assert bus.told(":1.1") == [
        ("SandboxChanged", ["rootpod", "set-up", 0, row]),
        ("SandboxChanged", [MINE, "set-up", 1001, row]),
        ("AttachmentDrifted", ["rootpod", "pods", "eth0", "rule gone"]),
        ("AttachmentDrifted", [MINE, "pods", "eth0", "rule gone"])]
    assert bus.told(":1.2") == [
        ("SandboxChanged", ["m1", "set-up", 1001, row]),
        ("AttachmentDrifted", ["m1", "pods", "eth0", "rule gone"])]
    assert bus.told(":1.3") == []  # another uid's: nothing
    assert all(m.message_type is MessageType.SIGNAL and m.destination for m in bus.sent)


async def test_the_fifth_of_a_uid_is_busy_and_a_name_that_left_is_dropped() -> None:
    w, bus, events = watchers({})
    names = [f":1.{i}" for i in range(1, 7)]
    bus.present |= set(names)
    for name in names[:4]:
        await w.add(name, MEMBER)
    await w.add(names[0], MEMBER)  # a repeat: the same watcher
    with pytest.raises(AgentError) as e:
        await w.add(names[4], MEMBER)
    assert e.value.kind is ErrorKind.BUSY
    await w.add(names[5], ROOT)  # another uid's count is its own
    left = Message(message_type=MessageType.SIGNAL, sender="org.freedesktop.DBus",
                   path="/org/freedesktop/DBus", interface="org.freedesktop.DBus",
                   member="NameOwnerChanged", signature="sss", body=[names[0], names[0], ""])
    w.on_signal(left)
    await asyncio.sleep(0)
    await w.add(names[4], MEMBER)
    assert len(w) == 5
    # One that left before its match was in is dropped at once.
    await w.add(":1.99", ROOT)
    assert len(w) == 5
    for name in [*names[1:6]]:
        w.on_signal(Message(message_type=MessageType.SIGNAL, sender="org.freedesktop.DBus",
                            path="/org/freedesktop/DBus", interface="org.freedesktop.DBus",
                            member="NameOwnerChanged", signature="sss", body=[name, name, ""]))
    assert len(w) == 0 and events.on is False
