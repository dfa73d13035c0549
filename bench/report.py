"""Figures, the one table, the JSON file and the machine they were measured on."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench import REPO
from bench.anchor import identity, usable_anchor

Figure = dict[str, Any]


def p95(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def figure(name: str, samples: Iterable[float], unit: str = "ms", *, ratio: float | None = None,
           goal: str = "", passed: bool | None = None, note: str = "",
           verdict: dict[str, Any] | None = None) -> Figure:
    """One row: every sample, median/min/max/p95; `passed` None = informational.

    A line of the project's goals (bench/goals.py) also has `verdict`: its
    goal's own verdict (`passed` is the must's), what it was compared with and
    the agent's CPU above the floor per call; `goals.judge` makes all three."""
    s = [float(x) for x in samples]
    return {
        "name": name, "unit": unit, "samples": s, "n": len(s),
        "median": statistics.median(s) if s else None,
        "min": min(s) if s else None, "max": max(s) if s else None,
        "p95": p95(s) if s else None,
        "ratio": ratio, "goal": goal, "pass": passed, "note": note,
        **({"verdict": verdict} if verdict is not None else {}),
    }


def above_floor(above_ms: float | None) -> str:
    """The agent's CPU above the floor per call, as the tables print it."""
    return "" if above_ms is None else f"agent CPU {above_ms:+.2f} ms/call over the floor"


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """median(a) / median(b) of two interleaved series."""
    return statistics.median(a) / statistics.median(b)


def result(figures: list[Figure], notes: Sequence[str] = (), **details: Any) -> dict[str, Any]:
    """What a benchmark's `run` returns."""
    return {"figures": figures, "notes": list(notes), "details": details}


# --- the table -------------------------------------------------------------------------

COLUMNS = ("name", "median", "min", "max", "n", "ratio/goal", "verdict")


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("count", ""):
        return f"{value:g}"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def remarks(f: Figure) -> str:
    """The "ratio/goal" cell: ratio, goal and verdicts, CPU above the floor, note."""
    above = above_floor(f.get("verdict", {}).get("above_floor_ms"))
    parts = [f"{f['ratio']:.2f}x" if f["ratio"] is not None else "", f["goal"], above, f["note"]]
    return "; ".join(p for p in parts if p)


def verdict_word(f: Figure) -> str:
    """The must's verdict (a goal's own is in `remarks`)."""
    return {True: "pass", False: "FAIL", None: "info"}[f["pass"]]


def _rows(name: str, res: dict[str, Any]) -> list[tuple[str, ...]]:
    if res.get("error"):
        return [(name, "-", "-", "-", "0", res["error"].splitlines()[-1][:90], "ERROR")]
    return [(f["name"], number(f["median"], f["unit"]), number(f["min"], f["unit"]),
             number(f["max"], f["unit"]), str(f["n"]), remarks(f), verdict_word(f)) for f in res["figures"]]


def columns(rows: Sequence[Sequence[str]], right: Iterable[int] = ()) -> list[str]:
    """Rows as aligned text columns, the first row a header underlined."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines, flush_right = [], set(right)
    for i, r in enumerate(rows):
        cells = [c.rjust(w) if j in flush_right else c.ljust(w)
                 for j, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [COLUMNS] + [r for name, res in results.items() for r in _rows(name, res)]
    notes = [f"  [{name}] {n}" for name, res in results.items() for n in res.get("notes", [])]
    return "\n".join(columns(rows, right={1, 2, 3, 4}) + (["", "Notes:", *notes] if notes else []))


# --- machine and JSON ----------------------------------------------------------------------

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def source_state() -> dict[str, Any]:
    """The commit measured, and whether the tree differs from it."""
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_short": _git("rev-parse", "--short", "HEAD"),
        # Untracked files count too: a new module changes what runs.
        "git_dirty": bool(_git("status", "--porcelain")),
    }


def _anchor() -> str:
    """Which Go libcni anchor the libcni figures measured (or why none)."""
    binary, missing = usable_anchor()
    return identity(binary) if binary is not None else missing


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "dbus-fast": _version("dbus-fast"),
        "pyroute2": _version("pyroute2"),
        "libcni_anchor": _anchor(),
        **source_state(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Others may share the machine: the 1-minute load average when the run ended.
        "loadavg_end": os.getloadavg()[0],
    }


def write_json(path: Path, results: dict[str, dict[str, Any]], smoke: bool, loadavg_start: float,
               at_start: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the run's JSON; return it (bench/doc.py renders it). `at_start`: the
    `source_state()` when the run began, which is what it measured; a commit made
    or a file changed meanwhile is recorded too (`git_commit_end`, `git_dirty`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = machine()
    start = at_start or {}
    if start:
        start = {**start, "git_dirty": start["git_dirty"] or now["git_dirty"]}
        if start["git_commit"] != now["git_commit"]:
            start["git_commit_end"] = now["git_commit"]
    doc = {"smoke": smoke, "machine": {**now, **start, "loadavg_start": loadavg_start}, "benchmarks": results}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
