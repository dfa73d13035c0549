"""Journal fields for whatever is logged inside one sandbox operation.

`with log_fields(SANDBOX_ID=..., NETWORK=...)` around a step makes every log
line emitted within it (in this task, down to the runtime and the executor)
carry those fields, so `journalctl NETWORK=pods` finds the warnings of code
that never heard of the sandbox. A contextvar, because asyncio tasks each
carry their own copy: concurrent operations never mix their fields.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from types import MappingProxyType

# The structured fields a log line may carry; journald indexes them.
FIELDS = ("SANDBOX_ID", "NETWORK", "IFNAME", "CNI_COMMAND", "PLUGIN")
_KNOWN = frozenset(FIELDS)

_current: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "cni_agent_log_fields", default=MappingProxyType({}))


def log_fields(**fields: str) -> _Fields:
    """Add `fields` (empty values ignored) to every line logged inside the block."""
    for key in fields:
        if key not in _KNOWN:
            raise ValueError(f"not a journal field of ours: {sorted(set(fields) - _KNOWN)}")
    return _Fields(fields)


class _Fields:
    """The block of `log_fields`: a plain class, not @contextmanager (a generator
    and its wrapper per block, several blocks per call)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, str]) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        add = {k: v for k, v in self._fields.items() if v}
        self._token = _current.set({**_current.get(), **add} if add else _current.get())

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


class ContextFields(logging.Filter):
    """Copies the current fields onto each record; explicit `extra=` wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _current.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True
