"""`python -m bench --smoke` still runs every benchmark end to end and leaves nothing behind.

Only that the code works is checked here: the numbers are printed and written
to JSON, never asserted (speed goals live in the benchmarks, not in tests).
And that every goal of bench/goals.py is judged, and that --write-doc rewrites
only docs/performance.md's generated section.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import REPO, doc, goals
from bench.anchor import LIBCNI, go_build_info, identity, usable_anchor
from bench.harness import PREFIX
from bench.registry import BENCHMARKS
from bench.report import figure

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
    run = json.loads(out.read_text())
    assert run["smoke"] is True
    assert run["machine"]["nproc"] and run["machine"]["kernel"] and run["machine"]["python"]
    assert list(run["benchmarks"]) == list(BENCHMARKS)
    for name, res in run["benchmarks"].items():
        assert not res.get("error"), f"{name}: {res['error']}"
        assert res["figures"], name
        for fig in res["figures"]:
            assert fig["n"] >= 1 and len(fig["samples"]) == fig["n"], fig
            for key in ("median", "min", "max"):
                assert isinstance(fig[key], float) and math.isfinite(fig[key]), (name, fig)
    assert "name" in proc.stdout and "verdict" in proc.stdout  # the table
    # Every goal judged, both verdicts in its line: with the anchor or FAIL without it.
    judged = {f["name"]: f for res in run["benchmarks"].values() for f in res["figures"] if "verdict" in f}
    assert set(judged) == set(goals.GOALS), set(goals.GOALS) ^ set(judged)
    for fig in judged.values():
        assert "must ≤" in fig["goal"] and "goal ≤" in fig["goal"], fig
    assert "The project's goals" in proc.stdout
    assert not [row for row in goals.summary(run["benchmarks"]) if row[-1] == "not run"]
    doc_text = doc.render(run)
    assert all(f"`{name}`" in doc_text for name in goals.GOALS)
    after = _ours()
    left = {what: after[what] - before[what] for what in after}
    assert not any(left.values()), left


def test_the_straight_line_runs_beside_the_agent_and_cleans_up() -> None:
    """`python -m bench.straight`: every way ran a pod (a failed call fails the
    run), each printed with its CPU per call, and nothing is left behind."""
    before = _ours()
    proc = subprocess.run([sys.executable, "-m", "bench.straight", "--rounds", "1", "--warmup", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ways = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    anchored = usable_anchor()[0] is not None
    assert set(ways) == {"agent", "straight", "bare", "direct", "libcni" if anchored else "libcni:"}, \
        proc.stdout
    for way in ("agent", "straight", "bare"):
        assert re.search(r"CPU \d+\.\d+ ms .*ADD \d+\.\d+, CHECK \d+\.\d+, DEL \d+\.\d+; "
                         r"pod \d+\.\d+ ms", ways[way]), ways[way]
        assert ("x libcni's" in ways[way]) is anchored
    after = _ours()
    left = {what: after[what] - before[what] for what in after}
    assert not any(left.values()), left


def test_a_goal_against_libcni_fails_without_the_anchor() -> None:
    judged = goals.judge("overhead.libcni_pair", None, missing=goals.ANCHOR_MISSING, above_floor_ms=1.0)
    assert judged["passed"] is False and judged["verdict"]["goal_passed"] is False
    assert judged["goal"].startswith("must ≤1.5x: FAIL, goal ≤1.2x: FAIL (anchor missing")
    met = goals.judge("overhead.libcni_pair", 1.3)
    assert (met["passed"], met["verdict"]["goal_passed"]) == (True, False)
    assert met["goal"] == "must ≤1.5x: PASS, goal ≤1.2x: FAIL"
    unknown = goals.judge("footprint.rss_start.vs_baseline", None, missing="no baseline")
    assert unknown["passed"] is None  # not a FAIL: nothing to compare with


def test_write_doc_rewrites_only_the_generated_section(tmp_path: Path) -> None:
    assert doc.BEGIN in doc.PAGE.read_text() and doc.END in doc.PAGE.read_text()
    page = tmp_path / "performance.md"
    head = f"# Performance\n\nprose naming `{doc.BEGIN}` and `{doc.END}` in passing\n\n"
    tail = "\n\nmore prose\n"
    page.write_text(f"{head}{doc.BEGIN}\nan old table\n{doc.END}{tail}")
    machine = {"date": "2026-12-07T10:00:00+00:00", "git_commit": "abcdef1234", "git_short": "abcdef1",
               "git_dirty": True, "nproc": 2, "cpu": "a CPU", "kernel": "6.1", "python": "3.11.2",
               "dbus-fast": "2.0", "loadavg_start": 0.5, "loadavg_end": 1.5,
               "libcni_anchor": "/c/libcni-anchor (go1.26.10, libcni v1.3.0)"}
    fig = figure("overhead.libcni_pair", [10.0, 12.0], ratio=1.3, note="a | note",
                 **goals.judge("overhead.libcni_pair", 1.3, above_floor_ms=2.5, versus="11 vs 8.5 ms"))
    run = {"smoke": False, "machine": machine,
           "benchmarks": {"overhead": {"figures": [fig], "notes": ["one note"]}}}
    doc.write(page, run)
    text = page.read_text()
    assert text.startswith(head + doc.BEGIN + "\n") and text.endswith(doc.END + tail)
    assert "an old table" not in text
    assert "2026-12-07 10:00 UTC, commit abcdef1 + uncommitted changes" in text
    assert "(not run: shim," in text and "a \\| note" in text
    assert "the Go libcni anchor /c/libcni-anchor (go1.26.10, libcni v1.3.0);" in text
    assert "| `overhead.libcni_pair` | " in text
    assert "| 1.30x (11 vs 8.5 ms) | +2.50 ms/call | must PASS, goal FAIL |" in text
    with pytest.raises(ValueError, match="smoke"):
        doc.write(page, {**run, "smoke": True})
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="no single <!-- bench:begin -->"):
        doc.write(page, run)


def _go_binary(path: Path, version: bytes, mod: bytes) -> None:
    """The build info section of a Go >= 1.18 binary, as its linker lays it out."""
    def prefixed(b: bytes) -> bytes:  # a uvarint length, 7 bits a byte
        n, out = len(b), bytearray()
        while n >= 0x80:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        return bytes(out) + bytes([n]) + b
    header = b"\xff Go buildinf:" + bytes([8, 2]) + bytes(16)
    sentinel = bytes(range(16))
    path.write_bytes(b"\x7fELF" + bytes(60) + header + prefixed(version)
                     + prefixed(sentinel + mod + sentinel) + bytes(32))


def test_the_anchor_is_named_with_its_go_and_libcni_versions(tmp_path: Path) -> None:
    """A run records which anchor it measured against: libcni's own CPU per call
    moves with the Go and libcni it was built with."""
    binary = tmp_path / "libcni-anchor"
    _go_binary(binary, b"go1.26.10", b"path\tx/cmd/anchor\nmod\tx\t(devel)\t\n"
               b"dep\tgithub.com/containernetworking/cni\tv1.3.0\t\nbuild\tGOOS=linux\n")
    assert go_build_info(binary) == ("go1.26.10", {LIBCNI: "v1.3.0"})
    (tmp_path / "commit").write_text("f954a17e505f8931e91004403b5f5eac71ab6085\n")
    assert identity(binary) == f"{binary} (go1.26.10, libcni v1.3.0, CRI-O f954a17e505f)"
    (tmp_path / "commit").write_text("unknown\n")  # a tree without git: no commit to name
    assert identity(binary) == f"{binary} (go1.26.10, libcni v1.3.0)"
    not_go = tmp_path / "not-go"
    not_go.write_bytes(b"\x7fELF" + bytes(100))
    assert go_build_info(not_go) == ("", {})
    assert identity(not_go) == f"{not_go} (Go version unknown, libcni version unknown)"


def test_a_real_go_binary_s_version_is_read_as_debian_built_it() -> None:
    """Debian's bridge plugin: the Go version its package says it was built with."""
    built_using = subprocess.run(["dpkg-query", "-W", "-f", "${Built-Using}",
                                  "containernetworking-plugins"],
                                 capture_output=True, text=True, check=True).stdout
    golang = next(p for p in built_using.split(", ") if p.startswith("golang-1."))
    upstream = golang.split("(= ")[1].split("-")[0]  # "golang-1.19 (= 1.19.8-2)"
    assert go_build_info(Path("/usr/lib/cni/bridge"))[0] == f"go{upstream}"
