"""The D-Bus API's names, shared by the agent and every client: bus name, object, interface, errors.

Imports nothing, so a client (`cni-agent status`) pays for none of the daemon.
"""

from __future__ import annotations

from enum import StrEnum

BUS_NAME = "org.cniagent.Agent1"
OBJECT_PATH = "/org/cniagent/Agent1"
INTERFACE = "org.cniagent.Agent1"
ERROR_PREFIX = "org.cniagent.Agent1.Error."
# Raised whenever a method, argument, option, property, signal or error name
# is added to the interface (nothing is ever removed from Agent1): a client
# checks `InterfaceRevision >= N` before it uses what revision N added.
# 1: Setup/Attach option netns_fd, Version, InterfaceRevision.
# 2: CheckSandboxes, AttachmentDrifted.
# 3: ResetPodCIDRs, PodCIDRsSource.
INTERFACE_REVISION = 3


class ErrorKind(StrEnum):
    """The last part of each D-Bus error name (`ERROR_PREFIX + kind`)."""

    INVALID_ARGUMENT = "InvalidArgument"
    NOT_READY = "NotReady"
    NOT_FOUND = "NotFound"
    BUSY = "Busy"
    PLUGIN_FAILED = "PluginFailed"
    TIMEOUT = "Timeout"
    ACCESS_DENIED = "AccessDenied"
    SHUTTING_DOWN = "ShuttingDown"
    CANCELLED = "Cancelled"


class AgentError(Exception):
    """A failure a caller can act on: a kind and one human line."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
