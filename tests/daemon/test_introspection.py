"""The live introspection of our interface equals the documented XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

import pytest

import cni_agent
from cni_agent.api import INTERFACE_REVISION
from tests.support.agent import NAME, REPO, Agent

pytestmark = pytest.mark.root
DOCUMENTED = REPO / "dbus" / "org.cniagent.Agent1.xml"


def interface_shape(xml: str) -> dict[str, Any]:
    """Methods (with ordered args), properties and signals of org.cniagent.Agent1."""
    root = ET.fromstring(xml)
    [iface] = [i for i in root.iter("interface") if i.get("name") == "org.cniagent.Agent1"]

    def args(el: ET.Element) -> list[tuple[str | None, str | None, str | None]]:
        return [(a.get("name"), a.get("type"), a.get("direction")) for a in el.iter("arg")]

    return {
        "methods": {m.get("name"): args(m) for m in iface.iter("method")},
        "properties": {p.get("name"): (p.get("type"), p.get("access"))
                       for p in iface.iter("property")},
        "signals": {s.get("name"): args(s) for s in iface.iter("signal")},
    }


def test_live_introspection_equals_the_documented_xml(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    out = agent.busctl("--json=short", "call", NAME, "/org/cniagent/Agent1",
                       "org.freedesktop.DBus.Introspectable", "Introspect")
    live = interface_shape(json.loads(out.stdout)["data"][0])
    documented = interface_shape(DOCUMENTED.read_text())
    assert live == documented
    assert len(live["methods"]) == 16 and len(live["properties"]) == 9
    assert live["methods"]["WatchSandboxes"] == []
    assert live["signals"] == {
        "AttachmentDrifted": [(n, "s", "out") for n in
                              ("sandbox_id", "network", "ifname", "reason")],
        "AttachmentCheckChanged": [(n, "s", "out") for n in
                                   ("sandbox_id", "network", "ifname", "state", "reason")],
        "SandboxChanged": [("sandbox_id", "s", "out"), ("change", "s", "out"),
                           ("owner_uid", "u", "out"), ("attachments", "a(ssssas)", "out")]}


def test_every_method_and_property_has_a_doc_comment() -> None:
    text = DOCUMENTED.read_text()
    for kind in ("method", "property"):
        for el in ET.fromstring(text).iter(kind):
            tag = f'<{kind} name="{el.get("name")}"'
            before = text[: text.index(tag)].rstrip()
            assert before.endswith("-->"), f"{el.get('name')} has no comment before it"


def test_version_and_interface_revision_say_what_a_client_talks_to(
    make_agent: Callable[..., Agent],
) -> None:
    agent = make_agent()
    assert agent.prop("Version") == cni_agent.__version__
    assert agent.prop("InterfaceRevision") == INTERFACE_REVISION >= 1
    out = agent.busctl("get-property", NAME, "/org/cniagent/Agent1", "org.cniagent.Agent1",
                       "InterfaceRevision")
    assert out.stdout.strip() == f"u {INTERFACE_REVISION}"
