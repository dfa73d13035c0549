"""The libcni anchor (bench/libcni_anchor.go): one Go process embedding libcni,
as containerd and CRI-O do. tools/build-crio builds it against CRI-O's vendored
libcni (`make test-crio` runs that); benchmarks use it when it is there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.cri.containerd import CACHE


def anchor_binary() -> Path | None:
    """The newest one tools/build-crio built (CNI_AGENT_LIBCNI_ANCHOR names another)."""
    named = os.environ.get("CNI_AGENT_LIBCNI_ANCHOR")
    if named:
        return Path(named)
    built = sorted((CACHE / "crio").glob("*/libcni-anchor"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


class Anchor:
    """The anchor process: one `pair` (ADD, DEL) or `pod` (ADD, CHECK, DEL, as CRI-O
    runs a pod) per netns path written to it."""

    def __init__(self, binary: Path, conflist: Path, plugin_dir: Path, cache_dir: Path) -> None:
        self.proc = subprocess.Popen([str(binary), str(conflist), str(plugin_dir), str(cache_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.cpu: list[float] = []  # its own CPU per line, ms

    def run(self, mode: str, netns: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{mode} {netns}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"libcni-anchor exited {self.proc.wait()}")
        self.cpu.append(int(line.split()[1]) / 1e6)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
