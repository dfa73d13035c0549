"""Watch the CNI config and plugin directories so readiness is re-evaluated quickly.

For each target we watch the directory itself (following symlinks) and its
deepest existing ancestor, for the name of the next path component, so that
creation, `rm -rf` + re-creation, replacement by a symlink and moves are seen;
likewise for its resolved path (a symlink whose target dir is re-created). When
a watch may be stale we re-arm, then report a change: events until the re-add
were missed, so the monitor must rescan. Errors go to `on_error` (the monitor
then polls) and we keep retrying.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_pyinotify: Any = None
try:
    with warnings.catch_warnings():
        # pyinotify imports asyncore (deprecated in 3.11; `pyasyncore` on 3.12+).
        warnings.simplefilter("ignore", DeprecationWarning)
        _pyinotify = importlib.import_module("pyinotify")
    _import_error = ""
except ImportError as exc:  # a packaging bug: degrade to polling rather than crash
    _import_error = f"pyinotify unavailable: {exc}"
# pyinotify adds its own stderr handler and logs routine conditions (stale watch
# descriptors, failed add_watch) as errors; we report those ourselves.
logging.getLogger("pyinotify").handlers.clear()
logging.getLogger("pyinotify").propagate = False
logging.getLogger("pyinotify").setLevel(logging.CRITICAL + 1)

_IN: dict[str, int] = dict(_pyinotify.EventsCodes.ALL_FLAGS) if _pyinotify else {}
# fmt: off
_VERBS = (  # the first matching flag names the event in the reason
    ("IN_CREATE", "created"), ("IN_DELETE", "removed"), ("IN_MOVED_TO", "moved in"),
    ("IN_MOVED_FROM", "moved out"), ("IN_CLOSE_WRITE", "written"), ("IN_UNMOUNT", "unmounted"),
    ("IN_ATTRIB", "attributes changed"), ("IN_DELETE_SELF", "deleted"), ("IN_MOVE_SELF", "moved"),
)
# fmt: on
# Events meaning the watched directory itself is gone or no longer at its path.
_SELF = ("IN_DELETE_SELF", "IN_MOVE_SELF", "IN_UNMOUNT")


# Why a directory is watched: as `target` itself, or for its `child` name.
@dataclass(frozen=True)
class _Role:
    target: str
    path: str
    child: str | None  # None: `path` is the target; else the next path component


def _plan(targets: Sequence[str]) -> list[_Role]:
    roles: set[_Role] = set()
    for target in targets:
        for path in {target, os.path.realpath(target)}:
            deepest = path
            while not os.path.isdir(deepest) and os.path.dirname(deepest) != deepest:
                deepest = os.path.dirname(deepest)
            if deepest == path:
                roles.add(_Role(target, path, None))
                deepest = os.path.dirname(path)  # to see it removed or replaced
            if deepest != path:
                roles.add(_Role(target, deepest, os.path.relpath(path, deepest).split(os.sep)[0]))
    # Ancestors first: a child replaced after its parent's watch exists is seen.
    return sorted(roles, key=lambda r: (len(r.path), r.path, r.child or "", r.target))


class DirWatcher:
    """Calls `on_change(reason)` (debounced) when anything under `paths` changes."""

    retry_interval = 1.0  # seconds between attempts to recover from an error

    def __init__(
        self,
        paths: Sequence[str],
        on_change: Callable[[str], None],
        on_error: Callable[[str], None] | None = None,
        debounce: float = 0.03,
    ) -> None:
        self._paths = [os.path.abspath(p) for p in paths]
        self._on_change, self._on_error, self._debounce = on_change, on_error, debounce
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wm: Any = None
        self._notifier: Any = None
        self._roles: dict[int, list[_Role]] = {}
        self._rearm_pending = False
        self._healthy = True
        self._last_error = ""
        self._stopped = False
        self._reasons: list[str] = []
        self._more = 0
        self._fire_handle: asyncio.TimerHandle | None = None
        self._retry_handle: asyncio.TimerHandle | None = None

    @property
    def healthy(self) -> bool:
        """False while inotify is unusable or some watch could not be placed."""
        return self._healthy

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._reopen()

    async def stop(self) -> None:
        self._stopped = True
        for handle in (self._fire_handle, self._retry_handle):
            if handle is not None:
                handle.cancel()
        self._fire_handle = self._retry_handle = None
        self._close()

    def _open(self) -> bool:
        assert self._loop is not None
        try:
            if _pyinotify is None:
                raise OSError(_import_error)
            self._wm = _pyinotify.WatchManager()
            # inotify_init() has no CLOEXEC: don't leak the fd into plugins.
            os.set_inheritable(self._wm.get_fd(), False)
            self._notifier = _pyinotify.Notifier(self._wm, default_proc_fun=self._on_event)
            self._loop.add_reader(self._wm.get_fd(), self._on_readable)
        except Exception as exc:  # e.g. EMFILE: too many inotify instances
            self._fail(f"inotify init failed: {exc}")
            return False
        return True

    def _close(self) -> None:
        if self._wm is not None and self._loop is not None:
            self._loop.remove_reader(self._wm.get_fd())
            self._wm.close()
        self._wm = self._notifier = None
        self._roles = {}

    def _fail(self, message: str) -> None:
        """Drop the inotify instance, report, and try again later."""
        self._close()
        self._retry(self.retry_interval, self._reopen)  # first: on_error may call stop()
        self._error(message)

    def _reopen(self) -> None:
        if self._open():
            self._arm()  # after an error, reports "restored": events were missed

    def _on_readable(self) -> None:
        try:
            self._notifier.read_events()
            self._notifier.process_events()
        except Exception as exc:  # never let a bad read stop monitoring
            self._fail(f"inotify read failed: {exc}")
            return
        if self._rearm_pending:
            self._rearm_pending = False
            self._arm()

    def _on_event(self, event: Any) -> None:
        mask = int(event.mask)
        if mask & _IN["IN_Q_OVERFLOW"]:
            self._rearm_pending = True
            self._note("inotify event queue overflowed")
            return
        wd, name = event.wd, event.name or ""
        verb = next((v for flag, v in _VERBS if mask & _IN[flag]), "changed")
        gone = any(mask & _IN[flag] for flag in _SELF)
        if mask & _IN["IN_IGNORED"]:  # always follows a reported event (delete, unmount)
            self._rearm_pending |= wd in self._roles
            self._roles.pop(wd, None)  # the kernel already dropped it
            return
        for role in self._roles.get(wd, ()):
            if role.child is None:
                self._rearm_pending |= gone
                self._note(f"{role.target}: {name or 'directory'} {verb}")
            elif gone or name == role.child:
                # An ancestor event on our path: the directory may have (dis)appeared.
                self._rearm_pending = True
                self._note(f"{role.target}: {os.path.join(role.path, name)} {verb}")

    def _note(self, reason: str) -> None:
        """Record a change; report it once per debounce window."""
        if self._stopped or self._loop is None:
            return
        if reason not in self._reasons:  # three are enough for a useful log line
            if len(self._reasons) < 3:
                self._reasons.append(reason)
            else:
                self._more += 1
        if self._fire_handle is None:
            self._fire_handle = self._loop.call_later(self._debounce, self._fire)

    def _fire(self) -> None:
        reason = "; ".join(self._reasons) + (f" (+{self._more} more)" if self._more else "")
        self._fire_handle, self._reasons, self._more = None, [], 0
        self._on_change(reason)  # if it raises, the loop's exception handler logs it

    def _error(self, message: str) -> None:
        self._healthy, repeated, self._last_error = False, message == self._last_error, message
        if repeated:  # retries fail the same way: don't flood the log
            return
        log.warning("directory watch: %s", message)
        if self._on_error is not None:
            try:
                self._on_error(message)
            except Exception:
                log.exception("directory watch: on_error callback failed")

    def _retry(self, delay: float, callback: Callable[[], None]) -> None:
        assert self._loop is not None
        if self._retry_handle is not None:
            self._retry_handle.cancel()
        self._retry_handle = self._loop.call_later(delay, callback)  # stop() cancels it

    def _arm(self) -> None:
        """Make the set of watches match what is on disk now."""
        mask = sum(_IN[flag] for flag, _ in _VERBS) | _IN["IN_ONLYDIR"]
        for _ in range(5):
            try:
                plan = _plan(self._paths)
                roles: dict[int, list[_Role]] = {}
                errors = []
                for role in plan:
                    try:
                        ret = self._wm.add_watch(role.path, mask, quiet=False)
                        roles.setdefault(next(iter(ret.values())), []).append(role)
                    except _pyinotify.WatchManagerError as exc:
                        errors.append(str(exc))
                for wd in self._roles.keys() - roles.keys():
                    self._wm.rm_watch(wd)
                self._roles = roles
                stable = _plan(self._paths) == plan
            except Exception as exc:
                errors, stable = [f"re-arming failed: {exc}"], True
            if stable:  # nothing moved while we were adding watches
                break
        else:  # paths keep changing under us: look again shortly
            self._retry(self._debounce, self._arm)
            return
        if errors:
            self._retry(self.retry_interval, self._arm)
            self._error("; ".join(errors))
        elif not self._healthy:
            self._healthy, self._last_error = True, ""
            self._note("inotify watches restored")  # the monitor must rescan
