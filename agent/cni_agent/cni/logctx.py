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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

# The structured fields a log line may carry; journald indexes them.
FIELDS = ("SANDBOX_ID", "NETWORK", "IFNAME", "CNI_COMMAND", "PLUGIN")

_current: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "cni_agent_log_fields", default=MappingProxyType({}))


@contextmanager
def log_fields(**fields: str) -> Iterator[None]:
    """Add `fields` (empty values ignored) to every line logged inside the block."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"not a journal field of ours: {sorted(unknown)}")
    token = _current.set({**_current.get(), **{k: v for k, v in fields.items() if v}})
    try:
        yield
    finally:
        _current.reset(token)


class ContextFields(logging.Filter):
    """Copies the current fields onto each record; explicit `extra=` wins."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _current.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True
