"""The project's performance goals, judged in one `make bench` run.

Each goal is a ratio with two bounds: the must (what the project promises;
it is the figure's `passed`) and the goal (where it wants to be). The
benchmark measuring one gives its figure `**judge(name, ratio, ...)`, and
`summary` gathers them all into one table after the run, beside each the
agent's CPU above the floor per call: what each future change costs.

The floor is what exec'ing the same plugins costs a process that does
nothing else: the benchmark's own thread running the chain directly from
Python (`overhead.direct` for the no-op chain; each benchmark measures it for
its own chain). Per call means per Setup or Teardown (half a pair), per shim
call for the runtimes' patterns.

Goals "against libcni" are judged against the Go libcni anchor
(bench/libcni_anchor.go, built by tools/build-crio): without it, or with one
built from another version of its source, they FAIL (anchor missing, anchor
stale), never compared with the Python floor instead.

Footprint goals compare with a baseline measured on an earlier commit
(`FOOTPRINT_BASELINE`; `BENCH_BASELINE=FILE` names another, see
`load_baseline`): "same or better" is within the spread measured between runs
(`SPREAD`, +5 %).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    """One line of the issue's table."""

    measure: str  # what the goals table calls it
    must: float  # a ratio: at most this
    goal: float
    anchored: bool = True  # judged against the libcni anchor: FAIL without it
    of: str = ""  # what the ratio is of, as the verdict text says it ("" for a plain ratio)


SPREAD = 1.05  # footprint: "same or better" than the baseline = at most +5 %

# The table, in its order; keyed by the figure that carries the verdict.
GOALS: dict[str, Goal] = {
    "overhead.libcni_pair": Goal(
        "Setup+Teardown over D-Bus / Go libcni's ADD+DEL, wall (3 no-op plugins)", 1.5, 1.2),
    "overhead.libcni.cpu": Goal("the agent's CPU per pair / libcni's own", 1.5, 1.0),
    "concurrency.noopnet.vs_libcni": Goal(
        "100 sandboxes at once, wall / Go libcni 100 at once (3 no-op plugins)", 1.5, 1.2),
    "concurrency.pods.vs_libcni": Goal(
        "100 sandboxes at once, wall / Go libcni 100 at once (bridge + host-local)", 1.5, 1.2),
    "cri.crio_pattern.pod": Goal(
        "CRI-O's pattern per pod through the shim / the chain exec'd directly", 1.10, 1.05,
        anchored=False),
    "cri.crio_pattern.agent_cpu": Goal(
        "the agent's CPU per shim call / libcni's own per call", 1.0, 0.7),
    "cri.pod": Goal("containerd's run+stop+remove per pod through the shim / containerd's own CNI",
                    1.0, 0.97, anchored=False),
    "footprint.rss_idle": Goal("RSS idle, 10 networks / the baseline's", SPREAD, SPREAD,
                               anchored=False, of=" the baseline"),
    "footprint.start.vs_baseline": Goal(
        "start → READY=1 and → first Setup at 0/100/1,000 sandboxes, worst / the baseline's",
        SPREAD, SPREAD, anchored=False, of=" the baseline"),
    "footprint.rss_start.vs_baseline": Goal(
        "RSS after start (READY, first Setup) at 0/100/1,000 sandboxes, worst / the baseline's",
        SPREAD, SPREAD, anchored=False, of=" the baseline"),
}

ANCHOR_MISSING = "anchor missing: tools/build-crio builds it"


def judge(name: str, ratio: float | None, *, missing: str = "", versus: str = "",
          above_floor_ms: float | None = None) -> dict[str, Any]:
    """`figure()` keywords for goal `name`: both verdicts in the goal text, `passed`
    the must's. `ratio` None: not measured, for the reason `missing` gives; that
    FAILs a goal against the anchor and leaves any other one unjudged."""
    g = GOALS[name]
    bounds = (("must", g.must), ("goal", g.goal))
    verdict = {"versus": versus, "above_floor_ms": above_floor_ms, "missing": ""}
    if ratio is None:
        verdict["missing"] = why = missing or "not measured"
        if not g.anchored:
            return {"goal": f"must ≤{g.must:g}x{g.of}, goal ≤{g.goal:g}x: {why}", "passed": None,
                    "verdict": {**verdict, "goal_passed": None}}
        text = ", ".join(f"{what} ≤{bound:g}x{g.of}: FAIL" for what, bound in bounds) + f" ({why})"
        return {"goal": text, "passed": False, "verdict": {**verdict, "goal_passed": False}}
    text = ", ".join(f"{what} ≤{bound:g}x{g.of}: {'PASS' if ratio <= bound else 'FAIL'}"
                     for what, bound in bounds)
    return {"goal": text, "passed": ratio <= g.must, "verdict": {**verdict, "goal_passed": ratio <= g.goal}}


# --- the table of all goals ---------------------------------------------------------------

SUMMARY_COLUMNS = ("figure", "measure", "must", "goal", "today", "agent CPU above the floor", "verdict")


def _verdict(fig: Mapping[str, Any] | None) -> str:
    if fig is None:
        return "not run"
    v = fig["verdict"]
    if v["missing"]:
        return v["missing"] if fig["pass"] is None else f"FAIL ({v['missing']})"
    word = {True: "PASS", False: "FAIL"}
    return f"must {word[fig['pass']]}, goal {word[v['goal_passed']]}"


def summary(results: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """One row per goal, in the issue's order (`SUMMARY_COLUMNS`); a goal whose
    benchmark did not run says so."""
    figures = {f["name"]: f for res in results.values() for f in res.get("figures", [])}
    rows: list[tuple[str, ...]] = []
    for name, g in GOALS.items():
        fig = figures.get(name)
        today, above = "-", ""
        if fig is not None:
            v = fig["verdict"]
            today = f"{fig['ratio']:.2f}x" if fig["ratio"] is not None else "-"
            today += f" ({v['versus']})" if v["versus"] else ""
            above = "" if v["above_floor_ms"] is None else f"{v['above_floor_ms']:+.2f} ms/call"
        rows.append((name, g.measure, f"≤{g.must:g}x", f"≤{g.goal:g}x", today, above,
                     _verdict(fig)))
    return rows


# --- the footprint's baseline ----------------------------------------------------------------

@dataclass(frozen=True)
class Baseline:
    """Footprint figures (medians) measured at `commit`; None: not recorded there."""

    commit: str
    date: str
    where: str
    figures: Mapping[str, float | None] = field(default_factory=dict)

    def ratio(self, name: str, today: float) -> float | None:
        base = self.figures.get(name)
        return today / base if base else None


# main at 9c759a8, before the lean branch, on the machine `make bench` runs on now
# (a 2-core Debian 12 VM; the machine was replaced on 2026-12-07, so the baseline
# was measured again there: start-up times differ by up to 20 % between two such
# VMs, the same code). (A figure left None prints "no baseline".)
FOOTPRINT_BASELINE = Baseline("9c759a8", "2026-12-07",
                              "the 2-core Debian 12 VM the project measures on, quiet", {
    # Its own bench/footprint.py, with the RSS sample after the first Setup added.
    "footprint.rss_idle": 48.18,
    "footprint.start.ready.0": 440.0, "footprint.start.ready.100": 422.0,
    "footprint.start.ready.1000": 470.0,
    "footprint.start.serving.0": 454.0, "footprint.start.serving.100": 460.0,
    "footprint.start.serving.1000": 690.0,
    "footprint.rss_start.0": 47.30, "footprint.rss_start.100": 47.78,
    "footprint.rss_start.1000": 50.86,
})


def load_baseline(path: Path) -> Baseline:
    """A baseline from a file: {"commit", "date", "where", "figures": {name: median}},
    or the JSON of a `python -m bench` run (its footprint figures' medians)."""
    doc = json.loads(path.read_text())
    if "benchmarks" not in doc:
        return Baseline(doc["commit"], doc["date"], doc.get("where", str(path)), doc["figures"])
    m = doc["machine"]
    figures = {f["name"]: f["median"] for f in doc["benchmarks"].get("footprint", {}).get("figures", [])
               if not f["name"].endswith(".vs_baseline")}  # verdicts, not figures
    commit = m.get("git_short") or m["git_commit"][:7]
    return Baseline(commit + (" + uncommitted changes" if m.get("git_dirty") else ""), m["date"][:10],
                    f"{path}: {m.get('nproc')} cores, {m.get('cpu') or 'unknown CPU'}", figures)


def footprint_baseline() -> Baseline:
    """The stored baseline, or the one the file BENCH_BASELINE names."""
    named = os.environ.get("BENCH_BASELINE")
    return load_baseline(Path(named)) if named else FOOTPRINT_BASELINE
