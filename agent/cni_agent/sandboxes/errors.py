"""Every exception the daemon's layers raise, as the one `api.AgentError` it means.

The core raises AgentErrors (or `cni_agent.cni` errors and lock timeouts,
classified here), so the D-Bus layer is a lookup, never a guess.
"""

from __future__ import annotations

from types import TracebackType

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import (
    CacheError,
    ConfigError,
    ExecError,
    InvalidArgument,
    NoCachedResult,
    PluginError,
    PluginTimeout,
    ResultError,
)
from cni_agent.node.locks import LockTimeout
from cni_agent.sandboxes.spoofguard import AntispoofFailed


class Hinted(AgentError):
    """An error whose message ends with a hint the agent knows (a failed ADD on
    a full pool): `hint` alone, for the shim's CNI error `details`."""

    def __init__(self, kind: ErrorKind, message: str, hint: str) -> None:
        super().__init__(kind, f"{message} (hint: {hint})")
        self.hint = hint


def classify(exc: BaseException) -> AgentError:
    """The agent error for any exception the core can raise."""
    if isinstance(exc, AgentError):
        return exc
    if isinstance(exc, InvalidArgument):
        return AgentError(ErrorKind.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, NoCachedResult):
        return AgentError(ErrorKind.NOT_FOUND, str(exc))
    if isinstance(exc, PluginTimeout):
        return AgentError(ErrorKind.TIMEOUT, str(exc))
    if isinstance(exc, LockTimeout):
        return AgentError(ErrorKind.BUSY, str(exc))
    if isinstance(exc, PluginError | ExecError | ResultError):
        return AgentError(ErrorKind.PLUGIN_FAILED, str(exc))
    if isinstance(exc, AntispoofFailed):
        # The ADD ran, but the pod could not be filtered: as good as a failed ADD.
        return AgentError(ErrorKind.PLUGIN_FAILED, f"{exc}; the ADD is undone")
    if isinstance(exc, ConfigError):
        return AgentError(ErrorKind.NOT_READY, str(exc))
    if isinstance(exc, CacheError | OSError):
        # The agent's own disk (state_dir, runtime_dir): full, read-only,
        # unreadable now. Never a plugin's failure.
        return AgentError(ErrorKind.STATE_ERROR, f"agent state error: {exc}")
    return AgentError(ErrorKind.PLUGIN_FAILED, f"internal error: {type(exc).__name__}: {exc}")


class _Classified:
    """`with classified():` re-raises anything the core raises as its AgentError
    (one already is: as it is, since `raise e from e` would make it its own
    cause). A plain class, not @contextmanager: a generator and its wrapper per
    block, several blocks per call."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(e, Exception) and not isinstance(e, AgentError):
            raise classify(e) from e


classified = _Classified
