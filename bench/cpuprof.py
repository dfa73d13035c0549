"""`python bench/cpuprof.py OUT -m MODULE ARGS…`: MODULE as __main__ under cProfile, timed
in CPU seconds of the main thread (time.thread_time), not wall: waiting (for the bus,
for a child to exec, for an fsync) costs the agent nothing and shows as nothing.
Worker threads are not profiled. bench/harness.py uses it for BENCH_AGENT_CPROFILE.
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, flag, module = sys.argv[1:4]
    if flag != "-m":
        raise SystemExit(__doc__)
    sys.argv = [module, *sys.argv[4:]]
    sys.path.pop(0)  # bench/, where this script is: not the module's
    prof = cProfile.Profile(time.thread_time)
    try:
        prof.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
