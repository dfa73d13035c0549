"""Protocol Buffers' wire format, as much as the CRI messages these tests send
and read need: varints and length-delimited fields, nothing else.

Field numbers are those of k8s.io/cri-api's `runtime/v1` api.proto (the
release containerd 2.1 is built with); each message below names its type.
A hand encoder instead of generated stubs keeps the test's dependencies to
the gRPC transport alone (grpcio) and the proto out of this tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

Value = int | bool | str | bytes


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int32/int64: two's complement in ten bytes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode(*fields: tuple[int, Value | None]) -> bytes:
    """A message from (field number, value) pairs; a repeated field is one pair
    per element. Proto3 defaults (None, 0, False, "") are left out, as protobuf
    does. bytes is an already encoded sub-message."""
    out = bytearray()
    for num, value in fields:
        if value is None or value == 0 or value == "" or value is False:
            continue
        if isinstance(value, bool | int):
            out += _varint(num << 3) + _varint(int(value))
        else:
            data = value.encode() if isinstance(value, str) else value
            out += _varint(num << 3 | 2) + _varint(len(data)) + data
    return bytes(out)


def entries(fieldnum: int, mapping: dict[str, str]) -> Iterable[tuple[int, Value | None]]:
    """A map<string, string> field: one entry message (key = 1, value = 2) per item."""
    return [(fieldnum, encode((1, k), (2, v))) for k, v in mapping.items()]


@dataclass
class Message:
    """A decoded message: each field number's values in order (varints as int,
    everything length-delimited as bytes, to be read as str or a sub-message)."""

    fields: dict[int, list[int | bytes]] = field(default_factory=dict)

    @classmethod
    def parse(cls, data: bytes) -> Message:
        msg, i = cls(), 0

        def varint() -> int:
            nonlocal i
            n = shift = 0
            while True:
                byte = data[i]
                i += 1
                n |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    return n

        while i < len(data):
            key = varint()
            num, kind = key >> 3, key & 7
            value: int | bytes
            if kind == 0:
                value = varint()
            elif kind == 2:
                size = varint()
                value, i = data[i:i + size], i + size
            elif kind in (1, 5):  # fixed64/fixed32: none in what we read, but skip them
                width = 8 if kind == 1 else 4
                value, i = data[i:i + width], i + width
            else:
                raise ValueError(f"wire type {kind} of field {num}")
            msg.fields.setdefault(num, []).append(value)
        return msg

    def uint(self, num: int) -> int:
        values = self.fields.get(num, [0])
        assert isinstance(values[-1], int)
        return values[-1]

    def text(self, num: int) -> str:
        values = self.fields.get(num, [b""])
        assert isinstance(values[-1], bytes)
        return values[-1].decode()

    def sub(self, num: int) -> Message:
        values = self.fields.get(num, [b""])
        assert isinstance(values[-1], bytes)
        return Message.parse(values[-1])

    def subs(self, num: int) -> list[Message]:
        return [Message.parse(v) for v in self.fields.get(num, []) if isinstance(v, bytes)]

    def strmap(self, num: int) -> dict[str, str]:
        """A map<string, string> field."""
        return {m.text(1): m.text(2) for m in self.subs(num)}
