"""Why NetworkReady is false, as a small fixed set of names.

`LastError` and `Status` say it in words that vary (file names, a plugin's
message); these names do not, so a metric label (`cni_agent_not_ready_reason`)
and an alert can carry them. One per row of the "NetworkReady is false" table
of docs/troubleshooting.md; a new reason is a new name here and a new row
there, never a new meaning for an old name.
"""

from __future__ import annotations

NOT_CHECKED = "not_checked"  # the default network's first STATUS has not answered
NO_NETWORK = "no_network"  # no valid network configuration (and no fallback)
DEFAULT_NOT_FOUND = "default_not_found"  # default_network pins a name no file has
DEFAULT_INVALID = "default_invalid"  # the pinned network's file is refused
STATUS_FAILED = "status_failed"  # the default network's STATUS fails
SHUTTING_DOWN = "shutting_down"  # SIGTERM: the agent is stopping
INTERNAL_ERROR = "internal_error"  # the agent's own evaluation failed (a bug)

REASONS = (NOT_CHECKED, NO_NETWORK, DEFAULT_NOT_FOUND, DEFAULT_INVALID, STATUS_FAILED,
           SHUTTING_DOWN, INTERNAL_ERROR)
