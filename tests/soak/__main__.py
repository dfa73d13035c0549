"""`make soak`: the long runs. Prints one summary table; exit 1 on any failure or leak."""

from __future__ import annotations

import argparse
import sys

from tests.soak.harness import crashes, gc_and_waiting, power_loss, reboot, soak, table


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak")
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--sandboxes", type=int, default=50)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--kills", type=int, default=100)
    args = p.parse_args()
    reports = [soak(args.ops, args.sandboxes, args.workers),
               gc_and_waiting(args.ops // 5, workers=args.workers // 2),
               crashes(args.kills), power_loss(args.kills // 2), reboot(20)]
    print(table(reports))
    bad = any(r.failures or r.leaks for r in reports)
    print("soak: FAILED" if bad else "soak: no failures, no leaks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
