"""`python bench/sectionprobe.py OUT -m MODULE ARGS…`: MODULE as __main__, with the
functions CNI_AGENT_SECTIONS names wrapped to add up the CPU time of the main
thread (time.thread_time) spent inside each, and count their calls.

CNI_AGENT_SECTIONS: comma-separated `module:Class.method` or `module:function`
(a function is replaced in that module's namespace: name the module that calls
it). A coroutine's time is counted from its call to its return, awaits
included: whatever the loop ran meanwhile counts too (in a sequential benchmark,
timers and background work). SIGUSR1 starts a window (dropping what came
before), SIGUSR2 writes OUT (JSON: per section, ns and calls; the main
thread's, and the process's in user space and in the kernel, over the
window). bench/sections.py runs it.

With CNI_AGENT_COUNT_CALLS=1 the window counts instead every function call of
the main thread (sys.setprofile: Python functions by code object, C functions
by name; a coroutine once per resumption, as the profiler reports it), which
slows everything it counts: the CPU figures then mean nothing.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_clock = time.thread_time_ns


class _CallCounter:
    """Calls of the main thread by function, while installed: how much code
    a call runs, which a CPU profile of cold code hides."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            self.counts[f"py {_short(code.co_filename)}:{code.co_firstlineno} "
                        f"{code.co_qualname}"] += 1
        elif event == "c_call":
            self.counts[f"C {getattr(arg, '__qualname__', repr(arg))}"] += 1


def _short(filename: str) -> str:
    """A source file's name from its package on: the agent's, a library's, the
    standard library's (contextlib.py)."""
    for marker in ("/site-packages/", "/agent/"):
        _, found, tail = filename.rpartition(marker)
        if found:
            return tail
    _, found, tail = filename.rpartition("/lib/python3")
    return tail.partition("/")[2] if found else filename


def _wrap(func: Callable[..., Any], key: str, spent: dict[str, list[int]]) -> Callable[..., Any]:
    tally = spent.setdefault(key, [0, 0])
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t0 = _clock()
            try:
                return await func(*args, **kwargs)
            finally:
                tally[0] += _clock() - t0
                tally[1] += 1
        return timed_async

    @functools.wraps(func)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = _clock()
        try:
            return func(*args, **kwargs)
        finally:
            tally[0] += _clock() - t0
            tally[1] += 1
    return timed


def install(specs: str, spent: dict[str, list[int]]) -> None:
    for spec in filter(None, (s.strip() for s in specs.split(","))):
        module_name, _, name = spec.partition(":")
        owner: Any = importlib.import_module(module_name)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = inspect.getattr_static(owner, attr)
        if isinstance(raw, (staticmethod, classmethod)):
            raise SystemExit(f"{spec}: a static or class method cannot be wrapped here")
        setattr(owner, attr, _wrap(getattr(owner, attr), name, spent))


def main() -> None:
    # Run as a script, sys.path[0] is bench/: its parent holds the bench package
    # (`module_argv` drops the entry before MODULE runs).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from bench.cpuprof import module_argv, run_module

    out, module = module_argv(__doc__ or "")
    spent: dict[str, list[int]] = {}
    install(os.environ.get("CNI_AGENT_SECTIONS", ""), spent)
    start = [_clock(), *os.times()[:2]]
    counter = _CallCounter() if os.environ.get("CNI_AGENT_COUNT_CALLS") == "1" else None

    def begin() -> None:
        for tally in spent.values():
            tally[:] = [0, 0]
        start[:] = [_clock(), *os.times()[:2]]
        if counter is not None:
            counter.counts.clear()
            sys.setprofile(counter)

    def dump() -> None:
        if counter is not None:
            sys.setprofile(None)
        user, system = os.times()[:2]
        # The process's CPU in user space (Python, libraries) and in the
        # kernel (its syscalls): which of the two a change can win from.
        doc = {"main_thread_ns": _clock() - start[0],
               "user_ns": int((user - start[1]) * 1e9),
               "system_ns": int((system - start[2]) * 1e9),
               "sections": spent,
               "calls": dict(counter.counts) if counter is not None else None}
        with open(out, "w") as f:
            json.dump(doc, f)

    run_module(module, begin, dump)


if __name__ == "__main__":
    main()
