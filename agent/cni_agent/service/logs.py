"""Logging: journald with structured fields under systemd, readable stderr otherwise."""

from __future__ import annotations

import logging
import os
import sys

from cni_agent.cni.logctx import FIELDS, ContextFields


class _StderrFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = [f"{k}={getattr(record, k)}" for k in FIELDS if hasattr(record, k)]
        return f"{text} [{' '.join(fields)}]" if fields else text


def _under_journald() -> bool:
    """systemd sets JOURNAL_STREAM when stderr is connected to the journal."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    if not stream or ":" not in stream:
        return False
    try:
        dev, ino = (int(x) for x in stream.split(":", 1))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(level: str = "info") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if _under_journald():
        from systemd.journal import JournalHandler

        handler = JournalHandler(SYSLOG_IDENTIFIER="cni-agent")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_StderrFormatter("%(asctime)s %(levelname)-7s %(message)s",
                                              "%Y-%m-%d %H:%M:%S"))
    # On the handler, not a logger: records of every logger pass through it.
    handler.addFilter(ContextFields())
    root.addHandler(handler)
    set_log_level(level)


def set_log_level(level: str) -> None:
    """At start and on a reload."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    # Library chatter stays out of the agent's log unless debugging.
    for noisy in ("pyroute2", "pyinotify", "dbus_fast"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
