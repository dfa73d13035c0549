"""docs/performance.md's generated section, from one run's results.

`python -m bench --write-doc` rewrites what lies between the page's two
markers (`BEGIN`, `END`) from the run it has just made: the goals table, every
figure and the notes, stamped with the date, the commit (and whether the tree
had uncommitted changes), the machine and its load. The rest of the page is
prose, written by hand; the figures are only ever generated, so the page
cannot state figures no run measured. `python -m bench.doc [JSON]` does the
same from a run's JSON (out/bench.json by default): the stamp is still the run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import REPO
from bench.goals import SUMMARY_COLUMNS, summary
from bench.registry import BENCHMARKS
from bench.report import number, remarks, verdict_word

PAGE = REPO / "docs" / "performance.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def stamp(doc: Mapping[str, Any]) -> str:
    """When, on what and under which load the run measured."""
    m = doc["machine"]
    when = datetime.datetime.fromisoformat(m["date"]).strftime("%Y-%m-%d %H:%M UTC")
    commit = m.get("git_short") or m["git_commit"][:7]
    commit += " + uncommitted changes" if m["git_dirty"] else ""
    if m.get("git_commit_end"):  # someone committed while it ran
        commit += f" (HEAD {m['git_commit_end'][:7]} by its end)"
    ran = list(doc["benchmarks"])
    skipped = [name for name in BENCHMARKS if name not in ran]
    which = "every benchmark" if not skipped else f"only {', '.join(ran)} (not run: {', '.join(skipped)})"
    return (f"Generated from one `python -m bench` run on {when}, commit {commit}: "
            f"{which}; {m['nproc']} cores ({m['cpu'] or 'unknown CPU'}), kernel {m['kernel']}, "
            f"Python {m['python']}, dbus-fast {m['dbus-fast']}; the Go libcni anchor "
            f"{m.get('libcni_anchor') or 'not recorded'}; load average {m['loadavg_start']:.2f} "
            f"at the start, {m['loadavg_end']:.2f} at the end. Not edited by hand: rerun it.")


def render(doc: Mapping[str, Any]) -> str:
    """The section between the markers (without them)."""
    results = doc["benchmarks"]
    figures = []
    for name, res in results.items():
        if res.get("error"):
            figures.append((name, "-", "-", "-", "0", res["error"].splitlines()[-1], "ERROR"))
        figures += [(f"`{f['name']}`", number(f["median"], f["unit"]), number(f["min"], f["unit"]),
                     number(f["max"], f["unit"]), str(f["n"]), remarks(f), verdict_word(f))
                    for f in res.get("figures", [])]
    notes = [f"- {_cell(n) if n.startswith(name) else f'{name}: {_cell(n)}'}"
             for name, res in results.items() for n in res.get("notes", [])]
    lines = [
        stamp(doc), "",
        "### The goals", "",
        "Each goal's must and goal are ratios (at most); \"agent CPU above the floor\" is the "
        "agent's CPU per call beyond what exec'ing the same plugins costs a Python process "
        "that does nothing else.", "",
        *_table(SUMMARY_COLUMNS, [(f"`{r[0]}`", *r[1:]) for r in summary(results)]), "",
        "### Every figure", "",
        "Median, min and max of n samples; ratio, goal and verdicts, notes: as `make bench` "
        "prints them.", "",
        *_table(("figure", "median", "min", "max", "n", "ratio, goal, note", "verdict"), figures),
    ]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines)


def write(page: Path, doc: Mapping[str, Any]) -> None:
    """Replace the page's generated section with this run's."""
    if doc.get("smoke"):
        raise ValueError("a --smoke run's figures are no measurement: not written")
    lines = page.read_text().splitlines(keepends=True)
    # The markers are lines of their own: the prose may name them in passing.
    begins = [i for i, line in enumerate(lines) if line.rstrip("\n") == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.rstrip("\n") == END]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError(f"{page}: no single {BEGIN} … {END} section (each marker a line of its own)")
    head, tail = "".join(lines[:begins[0] + 1]), "".join(lines[ends[0]:])
    page.write_text(f"{head}{render(doc)}\n{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.doc", description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", type=Path, default=REPO / "out" / "bench.json")
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    try:
        write(args.page, json.loads(args.json.read_text()))
    except (OSError, ValueError) as e:
        print(f"bench.doc: {e}", file=sys.stderr)
        return 1
    print(f"{args.page}: generated section rewritten from {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
