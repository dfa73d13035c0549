"""Helpers around our scripted test plugin (tests/plugins/cni-test-plugin)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEST_PLUGIN = Path(__file__).resolve().parent.parent / "plugins" / "cni-test-plugin"
REFERENCE_PLUGIN_DIR = "/usr/lib/cni"


def install_plugin(plugin_dir: Path, name: str = "testplug") -> Path:
    """Copy the test plugin into a plugin dir under the type `name`."""
    plugin_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(plugin_dir, 0o755)
    target = plugin_dir / name
    shutil.copy(TEST_PLUGIN, target)
    os.chmod(target, 0o755)
    return target


class Control:
    """The control file that scripts the test plugin; rewritten atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record = path.with_suffix(".record.jsonl")
        self.data: dict[str, Any] = {"record": str(self.record)}
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)

    def set(self, verb: str, action: str = "succeed", **kw: Any) -> None:
        self.data[verb] = {"action": action, **kw}
        self.write()

    def clear(self, verb: str) -> None:
        self.data.pop(verb, None)
        self.write()

    def update(self, **kw: Any) -> None:
        self.data.update(kw)
        self.write()

    def records(self, phase: str | None = "start") -> list[dict[str, Any]]:
        try:
            lines = self.record.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = [json.loads(line) for line in lines if line.strip()]
        return [r for r in out if phase is None or r.get("phase") == phase]

    def commands(self) -> list[str]:
        return [r["command"] for r in self.records()]

    def reset_records(self) -> None:
        self.record.unlink(missing_ok=True)


def shell_plugin(tmp_path: Path, name: str, body: str) -> str:
    """An executable /bin/sh script `name` (in tmp_path/scripts) running `body`."""
    bindir = tmp_path / "scripts"
    bindir.mkdir(mode=0o755, exist_ok=True)
    script = bindir / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def ns_key(path: str) -> list[int]:
    """What a test plugin record's `netns_ino` is for the namespace at `path`."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def seen_netns(rec: dict[str, Any]) -> list[int] | str:
    """The namespace a recorded plugin run was given: its `ns_key`, or "" for none."""
    return rec["netns_ino"] if rec["env"]["CNI_NETNS"] else ""


def conflist(name: str, plugins: list[dict[str, Any]], version: str = "1.1.0", **extra: Any) -> bytes:
    return json.dumps({"cniVersion": version, "name": name, "plugins": plugins, **extra}).encode()


def write_conf(conf_dir: Path, filename: str, data: bytes) -> Path:
    """Write a config file atomically (as a careful user or operator would)."""
    conf_dir.mkdir(parents=True, exist_ok=True)
    tmp = conf_dir / f".{filename}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, conf_dir / filename)
    return conf_dir / filename


def wait_for(pred: Any, timeout: float = 10.0, interval: float = 0.01) -> Any:
    """`pred()` once it is true, checked every `interval` at first, then less
    often (up to every 0.1 s): a predicate that runs busctl or reads /proc costs
    CPU that the other tests of a 2-core machine wait for."""
    deadline = time.monotonic() + timeout
    most = max(interval, 0.1)
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {pred}")
        time.sleep(interval)
        interval = min(interval * 1.5, most)


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False
