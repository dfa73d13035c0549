"""Text from plugins and the disk, on its way into a D-Bus string (issue 36, item 1)."""

from __future__ import annotations

import pytest
from dbus_fast import Message, MessageType

from cni_agent.api import AgentError, ErrorKind, wire_text
from cni_agent.service.callers import sendable as _sendable


def marshals(text: str) -> bool:
    try:
        Message(message_type=MessageType.METHOD_RETURN, reply_serial=1, destination=":1.1",
                signature="s", body=[text])._marshall(False)
    except Exception:
        return False
    return True


def valid(text: str) -> bool:
    """What the D-Bus specification allows in a string: UTF-8 without NUL
    (dbus-fast before 2.x marshals NULs and lone surrogates all the same)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\0" not in text


@pytest.mark.parametrize("text", ["plain", "bad\0msg", "lone \ud800 surrogate", "\udcff\0",
                                  "é ü 😀", "x" * 10_000])
def test_whatever_a_plugin_printed_becomes_a_string_d_bus_carries(text: str) -> None:
    safe = wire_text(text)
    assert marshals(safe)
    assert len(safe) <= 4096 + 1
    if valid(text) and len(text) <= 4096:
        assert safe == text  # text that is fine already is left alone


def test_a_reply_d_bus_cannot_carry_is_a_named_error() -> None:
    assert _sendable(["a", "é"]) == ["a", "é"]
    for bad in ("a\0b", ["ok", "\ud800"]):
        with pytest.raises(AgentError) as e:
            _sendable(bad)
        assert e.value.kind is ErrorKind.PLUGIN_FAILED and marshals(e.value.message)
