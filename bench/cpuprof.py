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
from types import FrameType


def main() -> None:
    out, flag, module = sys.argv[1:4]
    if flag != "-m":
        raise SystemExit(__doc__)
    sys.argv = [module, *sys.argv[4:]]
    sys.path.pop(0)  # bench/, where this script is: not the module's
    prof = cProfile.Profile(time.thread_time)
    if os.environ.get("BENCH_CPROFILE_WINDOW") == "1":
        window(prof, out, module)
        return
    try:
        prof.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.dump_stats(out)


def window(prof: cProfile.Profile, out: str, module: str) -> None:
    # Signal handlers run in the main thread: the one the profiler follows.
    def start(signum: int, frame: FrameType | None) -> None:
        prof.clear()
        prof.enable()

    def stop(signum: int, frame: FrameType | None) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass


if __name__ == "__main__":
    main()
