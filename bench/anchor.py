"""The libcni anchor (bench/libcni_anchor.go): one Go process embedding libcni,
as containerd and CRI-O do. tools/build-crio builds it against CRI-O's vendored
libcni (`make test-crio` runs that); benchmarks use it when it is there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bench import goals
from tests.cri.containerd import CACHE

SOURCE = Path(__file__).resolve().parent / "libcni_anchor.go"


def anchor_binary() -> Path | None:
    """The newest one tools/build-crio built (CNI_AGENT_LIBCNI_ANCHOR names another)."""
    named = os.environ.get("CNI_AGENT_LIBCNI_ANCHOR")
    if named:
        return Path(named)
    built = sorted((CACHE / "crio").glob("*/libcni-anchor"), key=lambda p: p.stat().st_mtime)
    return built[-1] if built else None


def usable_anchor() -> tuple[Path | None, str]:
    """(the anchor, "") or (None, why not: what the goals' FAIL says).

    tools/build-crio keeps the source it built next to the binary: one built from
    another bench/libcni_anchor.go may lack a mode the benchmarks send, so it
    counts as missing until rebuilt. One named by CNI_AGENT_LIBCNI_ANCHOR is
    taken as it is."""
    binary = anchor_binary()
    if binary is None or not binary.exists():
        return None, goals.ANCHOR_MISSING
    built_from = binary.parent / SOURCE.name
    if "CNI_AGENT_LIBCNI_ANCHOR" not in os.environ and (
            not built_from.exists() or built_from.read_bytes() != SOURCE.read_bytes()):
        return None, f"anchor stale: {binary} was built from another {SOURCE.name}; rerun tools/build-crio"
    return binary, ""


_BUILDINFO = b"\xff Go buildinf:"
_INLINE_STRINGS = 0x2  # Go >= 1.18: version and module info follow the header
LIBCNI = "github.com/containernetworking/cni"


def _uvarint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def go_build_info(binary: Path) -> tuple[str, dict[str, str]]:
    """What a Go binary says it was built with, as `go version -m` prints it (no
    Go toolchain needed): the Go version and each module dependency's version.
    ("", {}) when it holds no build info this reads (before Go 1.18)."""
    data = binary.read_bytes()
    at = data.find(_BUILDINFO)
    # The header is 32 bytes, 16-aligned; then two length-prefixed strings.
    if at < 0 or at % 16 or len(data) < at + 32 or not data[at + 15] & _INLINE_STRINGS:
        return "", {}
    size, pos = _uvarint(data, at + 32)
    version = data[pos:pos + size].decode(errors="replace")
    size, pos = _uvarint(data, pos + size)
    mod = data[pos:pos + size]
    if len(mod) >= 33 and mod[-17:-16] == b"\n":  # the linker's 16-byte sentinels around it
        mod = mod[16:-16]
    deps = {}
    for line in mod.decode(errors="replace").splitlines():
        kind, _, rest = line.partition("\t")
        if kind == "dep":
            path, _, version_rest = rest.partition("\t")
            deps[path] = version_rest.split("\t")[0]
    return version, deps


def identity(binary: Path) -> str:
    """The anchor as it was built, for a run's record: its own CPU per call
    depends on the Go and libcni versions, so figures measured against two
    builds are not comparable."""
    go, deps = go_build_info(binary)
    commit_file = binary.parent / "commit"
    commit = commit_file.read_text().strip() if commit_file.exists() else ""
    parts = [go or "Go version unknown", f"libcni {deps.get(LIBCNI, 'version unknown')}"]
    if commit and commit != "unknown":
        parts.append(f"CRI-O {commit[:12]}")
    return f"{binary} ({', '.join(parts)})"


class Anchor:
    """The anchor process: per line written to it, one `pair` (ADD, DEL) or `pod`
    (ADD, CHECK, DEL, as CRI-O runs a pod) in one netns, or `many`: ADD in
    every netns at once, then DEL in every one at once."""

    def __init__(self, binary: Path, conflist: Path, plugin_dirs: Path | str, cache_dir: Path) -> None:
        """`plugin_dirs`: one directory, or several joined with ":"."""
        self.proc = subprocess.Popen([str(binary), str(conflist), str(plugin_dirs), str(cache_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.cpu: list[float] = []  # its own CPU per line, ms

    def run(self, mode: str, *netns: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{mode} {' '.join(netns)}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"libcni-anchor exited {self.proc.wait()}")
        self.cpu.append(int(line.split()[1]) / 1e6)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
