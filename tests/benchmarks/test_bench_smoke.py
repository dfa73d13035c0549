"""`python -m bench --smoke` still runs every benchmark end to end and leaves nothing behind.

Only that the code works is checked here: the numbers are printed and written
to JSON, never asserted (speed goals live in the benchmarks, not in tests).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import REPO
from bench.harness import PREFIX
from bench.registry import BENCHMARKS

pytestmark = pytest.mark.root


def _ours() -> dict[str, set[str]]:
    """Netns and links named like the benchmarks' ones; processes running from their temp dirs."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True,
                                      check=True).stdout)
    procs = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "cni-bench-" in cmdline:
            procs.add(f"{pid} {cmdline}")
    return {
        "netns": {line.split()[0] for line in netns.splitlines() if line.startswith(PREFIX)},
        "links": {link["ifname"] for link in links if link["ifname"].startswith(PREFIX)},
        "processes": procs,
        "temp dirs": {p.name for p in Path("/tmp").glob("cni-bench-*")},
    }


def test_smoke_runs_every_benchmark_and_cleans_up(tmp_path: Path) -> None:
    before = _ours()
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["smoke"] is True
    assert doc["machine"]["nproc"] and doc["machine"]["kernel"] and doc["machine"]["python"]
    assert list(doc["benchmarks"]) == list(BENCHMARKS)
    for name, res in doc["benchmarks"].items():
        assert not res.get("error"), f"{name}: {res['error']}"
        assert res["figures"], name
        for fig in res["figures"]:
            assert fig["n"] >= 1 and len(fig["samples"]) == fig["n"], fig
            for key in ("median", "min", "max"):
                assert isinstance(fig[key], float) and math.isfinite(fig[key]), (name, fig)
    assert "name" in proc.stdout and "verdict" in proc.stdout  # the table
    after = _ours()
    left = {what: after[what] - before[what] for what in after}
    assert not any(left.values()), left
