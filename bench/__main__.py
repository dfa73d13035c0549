"""`python -m bench [--smoke] [--json PATH] [--only NAME…] [--write-doc [PAGE]]`: run,
print one table and the project's goals, write JSON.

A benchmark that raises is recorded as an error and the others still run.
Exit status: 2 for a usage error; 1 in --smoke mode if any benchmark errored
(so the smoke test catches rot), or if --write-doc could not write the page;
otherwise 0 — missed goals are reported, never turned into failures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import REPO, doc, goals
from bench.registry import BENCHMARKS
from bench.report import columns, source_state, table, write_json


def goals_table(results: dict[str, dict[str, Any]]) -> str:
    rows = [goals.SUMMARY_COLUMNS, *goals.summary(results)]
    return "\n".join(["The project's goals (bench/goals.py; a ratio: at most must, at most goal):", "",
                      *columns(rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one repetition of everything (seconds)")
    parser.add_argument("--json", type=Path, default=REPO / "out" / "bench.json", metavar="PATH")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)})")
    parser.add_argument("--write-doc", nargs="?", type=Path, const=doc.PAGE, metavar="PAGE",
                        help="rewrite the generated section of docs/performance.md (or PAGE) "
                             "from this run")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces, real plugins, a private system bus)")
    if args.write_doc and args.smoke:
        parser.error("--write-doc: a --smoke run's figures are no measurement")
    results: dict[str, dict[str, Any]] = {}
    started, load, source = time.monotonic(), os.getloadavg()[0], source_state()
    for name in args.only or list(BENCHMARKS):
        print(f"running {name}{' (smoke)' if args.smoke else ''} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            res = BENCHMARKS[name](args.smoke)
        except Exception:
            res = {"figures": [], "notes": [], "details": {}, "error": traceback.format_exc()}
            print(res["error"], file=sys.stderr)
        res["seconds"] = round(time.monotonic() - t0, 2)
        results[name] = res
    print(table(results))
    print()
    print(goals_table(results))
    run = write_json(args.json, results, args.smoke, load, source)
    print(f"\nThe Go libcni anchor: {run['machine']['libcni_anchor']}")
    print(f"\n{len(results)} benchmark(s) in {time.monotonic() - started:.0f} s on {os.cpu_count()} cores, "
          f"load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end; JSON: {args.json}")
    if args.write_doc:
        try:
            doc.write(args.write_doc, run)
        except (OSError, ValueError) as e:
            print(f"--write-doc: {e}", file=sys.stderr)
            return 1
        print(f"{args.write_doc}: generated section rewritten")
    errored = [name for name, res in results.items() if res.get("error")]
    return 1 if args.smoke and errored else 0


if __name__ == "__main__":
    sys.exit(main())
