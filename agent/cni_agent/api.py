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
# 4: AttachmentCheckChanged.
# 5: option netns_fd on Teardown, Detach and Check (a member's namespace again);
#    NetworkCapacity; WatchSandboxes and SandboxChanged, and the check signals
#    unicast to watchers; the options TRACEPARENT, TRACESTATE and BAGGAGE.
INTERFACE_REVISION = 5


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
    # The agent's own disk (state_dir full, read-only, unreadable): never a plugin's failure.
    STATE_ERROR = "StateError"


# What a D-Bus string of ours carries of text from plugins or the disk, at most.
WIRE_TEXT_LIMIT = 4096


def wire_text(text: str, limit: int = WIRE_TEXT_LIMIT) -> str:
    """`text` as a D-Bus string can carry it: cut to `limit` characters, NUL
    spelled `\\0`, lone surrogates (JSON's `"\\ud800"`, undecodable bytes of a
    file name) spelled `\\udXXX`.

    D-Bus strings are UTF-8 without NUL; a reply holding either cannot be
    marshalled, and dbus-fast fails that in a callback: the caller would get
    no reply at all. Every text a plugin or the disk supplied passes here on
    its way out (errors, properties, signals)."""
    if len(text) > limit:
        text = text[:limit] + "…"
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\0", "\\0") if "\0" in text else text


class AgentError(Exception):
    """A failure a caller can act on: a kind and one human line."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
