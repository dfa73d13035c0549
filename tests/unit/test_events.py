"""The sandbox events' seam (sandboxes/events.py): off without a listener,
addresses and MAC read from any CNI result version, a listener's defect
contained."""

from __future__ import annotations

from typing import Any

from cni_agent.sandboxes.events import (
    AttachmentEvent,
    Change,
    Events,
    SandboxEvent,
    State,
    addresses,
    mac,
)
from cni_agent.sandboxes.records import Attachment, Lost, Phase

V1 = {"cniVersion": "1.0.0",
      "interfaces": [{"name": "cni0", "mac": "AA:00:00:00:00:01"},
                     {"name": "veth1", "mac": "aa:00:00:00:00:02"},
                     {"name": "eth0", "mac": "0A:58:0A:00:00:05", "sandbox": "/run/netns/x"}],
      "ips": [{"address": "10.0.0.5/24", "interface": 2},
              {"address": "fd00::5/64", "interface": 2},
              {"address": "192.0.2.1/32", "interface": 0}]}


def test_addresses_and_mac_of_the_sandboxed_interface_in_every_version() -> None:
    assert addresses(V1, "eth0") == ("10.0.0.5/24", "fd00::5/64")
    assert mac(V1, "eth0") == "0a:58:0a:00:00:05"
    assert mac(V1, "net1") == "" and addresses(None, "eth0") == ()
    # No interface index (ipvlan's, 0.3.x without interfaces): the result's addresses.
    assert addresses({"ips": [{"address": "10.1.0.2/16"}]}, "eth0") == ("10.1.0.2/16",)
    assert addresses({"cniVersion": "0.2.0", "ip4": {"ip": "10.2.0.3/24"},
                      "ip6": {"ip": "fd01::3/64"}}, "eth0") == ("10.2.0.3/24", "fd01::3/64")


def test_without_a_listener_nothing_is_on_and_a_listener_is_told_once() -> None:
    events = Events()
    assert events.on is False
    told: list[SandboxEvent] = []
    events.listen(told.append)
    events.pause(True)
    assert events.on is False  # no watcher: emitters build nothing
    events.pause(False)
    assert events.on is True
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY, result=V1)
    events.emit(Change.SET_UP, "web", 0, [(att, State.READY)])
    assert told == [SandboxEvent("web", Change.SET_UP, 0, (AttachmentEvent(
        "pods", "eth0", State.READY, "0a:58:0a:00:00:05", ("10.0.0.5/24", "fd00::5/64")),))]
    # Nothing touched, nothing told; a lost attachment tells what it had.
    events.emit(Change.REAPED, "web", 0, [])
    lost = Attachment("pods", "eth0", b"{}", phase=Phase.READY,
                      lost=Lost(1.0, "no room", 1, 2.0, ("10.0.0.5/24",), "0a:58:0a:00:00:05"))
    events.emit(Change.LOST, "web", 1001, [(lost, State.LOST)])
    assert len(told) == 2 and told[1].attachments[0] == AttachmentEvent(
        "pods", "eth0", State.LOST, "0a:58:0a:00:00:05", ("10.0.0.5/24",))


def test_a_listeners_defect_never_fails_the_call() -> None:
    events = Events()

    def broken(event: Any) -> None:
        raise RuntimeError("boom")

    events.listen(broken)
    att = Attachment("pods", "eth0", b"{}", phase=Phase.READY, result=V1)
    events.emit(Change.TORN_DOWN, "web", 0, [(att, State.GONE)])  # logged, not raised
