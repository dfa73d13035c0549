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

from cni_agent.cni import tracectx

# The structured fields a log line may carry; journald indexes them. TRACE_ID
# is the W3C trace id of the call the line is about (`tracectx`), not a block's.
FIELDS = ("SANDBOX_ID", "NETWORK", "IFNAME", "CNI_COMMAND", "PLUGIN", "TRACE_ID")
_KNOWN = frozenset(FIELDS) - {"TRACE_ID"}

# The fields of the blocks the current task is in, outermost first, each as
# given: entering a block is one tuple and one ContextVar.set (a plugin run
# enters one), and merging happens only when a line is logged.
_current: contextvars.ContextVar[tuple[Mapping[str, str], ...]] = contextvars.ContextVar(
    "cni_agent_log_fields", default=())


class _Fields:
    """The block of `log_fields`: a plain class, not @contextmanager (a generator
    and its wrapper per block, several blocks per call), and the class itself
    (no function to call first)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: str) -> None:
        """Add `fields` (empty values ignored) to every line logged inside the block."""
        if not _KNOWN.issuperset(fields):
            raise ValueError(f"not a journal field of ours: {sorted(set(fields) - _KNOWN)}")
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _current.set((*_current.get(), self._fields))

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


log_fields = _Fields


class ContextFields(logging.Filter):
    """Copies the current fields onto each record: an inner block's over an
    outer one's, empty values ignored; explicit `extra=` wins. And the trace
    id of the call being served, if it has one."""

    def filter(self, record: logging.LogRecord) -> bool:
        for fields in reversed(_current.get()):
            for key, value in fields.items():
                if value and not hasattr(record, key):
                    setattr(record, key, value)
        call = tracectx.current()
        if call is not None and not hasattr(record, "TRACE_ID"):
            record.TRACE_ID = call.trace_id
        return True
