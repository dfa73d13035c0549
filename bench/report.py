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

Figure = dict[str, Any]


def p95(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def figure(name: str, samples: Iterable[float], unit: str = "ms", *, ratio: float | None = None,
           goal: str = "", passed: bool | None = None, note: str = "") -> Figure:
    """One row: every sample, median/min/max/p95; `passed` None = informational."""
    s = [float(x) for x in samples]
    return {
        "name": name, "unit": unit, "samples": s, "n": len(s),
        "median": statistics.median(s) if s else None,
        "min": min(s) if s else None, "max": max(s) if s else None,
        "p95": p95(s) if s else None,
        "ratio": ratio, "goal": goal, "pass": passed, "note": note,
    }


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """median(a) / median(b) of two interleaved series."""
    return statistics.median(a) / statistics.median(b)


def result(figures: list[Figure], notes: Sequence[str] = (), **details: Any) -> dict[str, Any]:
    """What a benchmark's `run` returns."""
    return {"figures": figures, "notes": list(notes), "details": details}


# --- the table -------------------------------------------------------------------------

COLUMNS = ("name", "median", "min", "max", "n", "ratio/goal", "verdict")


def _num(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("count", ""):
        return f"{value:g}"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def _rows(name: str, res: dict[str, Any]) -> list[tuple[str, ...]]:
    if res.get("error"):
        return [(name, "-", "-", "-", "0", res["error"].splitlines()[-1][:90], "ERROR")]
    rows: list[tuple[str, ...]] = []
    for f in res["figures"]:
        parts = [f"{f['ratio']:.2f}x" if f["ratio"] is not None else "", f["goal"], f["note"]]
        verdict = {True: "pass", False: "FAIL", None: "info"}[f["pass"]]
        rows.append((f["name"], _num(f["median"], f["unit"]), _num(f["min"], f["unit"]),
                     _num(f["max"], f["unit"]), str(f["n"]), "; ".join(p for p in parts if p), verdict))
    return rows


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [COLUMNS] + [r for name, res in results.items() for r in _rows(name, res)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    right = {1, 2, 3, 4}
    lines = []
    for i, r in enumerate(rows):
        cells = [c.rjust(w) if j in right else c.ljust(w)
                 for j, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [f"  [{name}] {n}" for name, res in results.items() for n in res.get("notes", [])]
    return "\n".join(lines + (["", "Notes:", *notes] if notes else []))


# --- machine and JSON ----------------------------------------------------------------------

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


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
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Others may share the machine: the 1-minute load average when the run ended.
        "loadavg_end": os.getloadavg()[0],
    }


def write_json(path: Path, results: dict[str, dict[str, Any]], smoke: bool, loadavg_start: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"smoke": smoke, "machine": {**machine(), "loadavg_start": loadavg_start}, "benchmarks": results}
    path.write_text(json.dumps(doc, indent=1) + "\n")
