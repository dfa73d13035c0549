"""Self-check of the test plugin's `record_fds`: the descriptors it started with, all of them."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.plugins.test_plugin_selfcheck import PLUGIN, Plugin, base_env


def run_with_fds(plugin: Plugin, pass_fds: tuple[int, ...]) -> list[dict[str, object]]:
    subprocess.run([str(PLUGIN)], input=json.dumps(plugin.conf()).encode(), env=base_env("ADD"),
                   capture_output=True, timeout=5, check=True, pass_fds=pass_fds)
    return plugin.records()


def test_record_fds_lists_what_the_plugin_inherited(tmp_path: Path) -> None:
    plugin = Plugin(tmp_path)
    plugin.set(record_fds=True)
    null = os.open("/dev/null", os.O_RDONLY)
    # Above 1023 too: /proc/self/fd lists every descriptor, whatever its number.
    high = os.dup2(null, 1500)
    try:
        start, end = run_with_fds(plugin, (null, high))
    finally:
        os.close(null)
        os.close(high)
    assert start["proc_fds"] == end["proc_fds"] == [0, 1, 2, null, high]
    plugin.record.unlink()
    assert [r["proc_fds"] for r in run_with_fds(plugin, ())] == [[0, 1, 2]] * 2


def test_no_proc_fds_unless_asked(tmp_path: Path) -> None:
    plugin = Plugin(tmp_path)
    plugin.set()
    assert all("proc_fds" not in r for r in run_with_fds(plugin, ()))
