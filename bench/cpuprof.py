"""`python bench/cpuprof.py OUT -m MODULE ARGS…`: MODULE as __main__ under cProfile, timed
in CPU seconds of the main thread (time.thread_time), not wall: waiting (for the bus,
for a child to exec, for an fsync) costs the agent nothing and shows as nothing.
Worker threads are not profiled. bench/harness.py uses it for BENCH_AGENT_CPROFILE.

With BENCH_CPROFILE_WINDOW=1 the profile covers only a window: SIGUSR1 starts it
(dropping what came before, e.g. start-up and a warm-up), SIGUSR2 stops it and
writes OUT (bench/crio_profile.py uses it).
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable


def module_argv(usage: str) -> tuple[str, str]:
    """OUT and MODULE of this script's `OUT -m MODULE ARGS…`; sys.argv becomes the
    module's, and sys.path loses its first entry (this script's dir: not the
    module's). bench/sectionprobe.py runs the same way."""
    out, flag, module = sys.argv[1:4]
    if flag != "-m":
        raise SystemExit(usage)
    sys.argv = [module, *sys.argv[4:]]
    sys.path.pop(0)
    return out, module


def run_module(module: str, begin: Callable[[], object] | None = None,
               end: Callable[[], object] | None = None) -> None:
    """MODULE as __main__ until it exits; SIGUSR1 calls `begin`, SIGUSR2 `end`
    (a window). Signal handlers run in the main thread: the one measured."""
    if begin is not None:
        signal.signal(signal.SIGUSR1, lambda signum, frame: begin())
    if end is not None:
        signal.signal(signal.SIGUSR2, lambda signum, frame: end())
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass


def main() -> None:
    out, module = module_argv(__doc__ or "")
    prof = cProfile.Profile(time.thread_time)
    if os.environ.get("BENCH_CPROFILE_WINDOW") == "1":
        def start() -> None:  # drops what came before (start-up, a warm-up)
            prof.clear()
            prof.enable()

        def stop() -> None:
            prof.disable()
            prof.dump_stats(out)

        run_module(module, start, stop)
        return
    try:
        prof.runcall(run_module, module)
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
