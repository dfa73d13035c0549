"""Typed errors of the CNI runtime.

Every failure is wrapped once, with the plugin type and verb, so the message a
user finally reads says which plugin failed doing what.
"""

from __future__ import annotations

# CNI error codes (spec "Error" section).
CODE_INCOMPATIBLE_VERSION = 1
CODE_UNSUPPORTED_FIELD = 2
CODE_UNKNOWN_CONTAINER = 3
CODE_INVALID_ENV = 4
CODE_IO_FAILURE = 5
CODE_DECODE_FAILURE = 6
CODE_INVALID_CONFIG = 7
CODE_TRY_AGAIN_LATER = 11
CODE_NOT_AVAILABLE = 50
CODE_LIMITED_CONNECTIVITY = 51


class CNIError(Exception):
    """Base of every error raised by `cni_agent.cni`."""


class InvalidArgument(CNIError):
    """A caller-supplied value is malformed; `field` names which one."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ConfigError(CNIError):
    """A network configuration cannot be used; `source` is the file."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class ResultError(CNIError):
    """A CNI result cannot be parsed or converted."""


class CacheError(CNIError):
    """The result cache could not be read or written."""


class EntryKept(CacheError):
    """A DEL chain succeeded, but its cache entry could not be removed (the
    state dir full or read-only): the network is released, the entry is not."""


class NoCachedResult(CNIError):
    """CHECK of an attachment that has no cached ADD result."""


class PluginError(CNIError):
    """A plugin ran and reported an error (the CNI wire error)."""

    def __init__(
        self, plugin: str, verb: str, code: int, msg: str, details: str = ""
    ) -> None:
        text = f"plugin {plugin} {verb} failed (code {code}): {msg}"
        if details:
            text += f": {details}"
        super().__init__(text)
        self.plugin = plugin
        self.verb = verb
        self.code = code
        self.msg = msg
        self.details = details


class ExecError(CNIError):
    """A plugin could not be run or did not behave like a plugin."""

    def __init__(self, plugin: str, verb: str, what: str) -> None:
        super().__init__(f"plugin {plugin} {verb}: {what}")
        self.plugin = plugin
        self.verb = verb
        self.what = what


class PluginNotFound(ExecError):
    """No binary for the plugin type in any plugin directory."""


class PluginNotExecutable(ExecError):
    """The binary exists but cannot be executed."""


class PluginUnsafe(ExecError):
    """The binary or its directory could be replaced by a non-root user."""


class PluginTimeout(ExecError):
    """The plugin did not finish in time; its process group was killed."""

    def __init__(self, plugin: str, verb: str, timeout: float, what: str = "") -> None:
        # `what`: the runtime's wording when a chain's deadline ran out (it
        # names the chain; `timeout` 0: the plugin was never started).
        super().__init__(
            plugin, verb, what or f"timed out after {timeout:g}s (process group killed)"
        )
        self.timeout = timeout


class PluginKilled(ExecError):
    """The plugin was terminated by a signal."""

    def __init__(self, plugin: str, verb: str, signame: str) -> None:
        super().__init__(plugin, verb, f"killed by signal {signame}")
        self.signame = signame


class PluginBadOutput(ExecError):
    """The plugin's output is not what the protocol requires (garbage, too big)."""
