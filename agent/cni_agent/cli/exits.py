"""The CLI's exit statuses: one meaning each, the same for every command (docs/cli.md,
"Exit status"), so scripts can tell what happened without reading stderr."""

from __future__ import annotations

EXIT_OK = 0  # success (`state`: ready)
EXIT_FAILED = 1  # the operation failed (the agent's or a plugin's error)
EXIT_USAGE = 2  # usage or configuration error: a bad argument, file or value
EXIT_NOT_READY = 3  # the network is not ready, the agent is stopping, or waiting timed out
EXIT_DENIED = 4  # access denied (bus policy or the agent's own check)
EXIT_NOT_RUNNING = 5  # the agent is not running: nothing owns the bus name, or no bus
EXIT_INTERRUPTED = 130  # Ctrl-C, as the shell counts it
