"""Configuration files are bounded (issue 36, item 6): a FIFO, an oversize file or
a YAML alias bomb is a named error at once, for `config check`, start-up,
Reload and the network files of conf_dir.

A FIFO as a drop-in used to hang `config check` and start-up, and held a thread
at each reload; a FIFO in conf_dir stopped every later scan. A 258-byte alias
bomb took 2.9 s and 143 MiB to reject (a 9-level one: past 60 s and 2.4 GB),
because the error message printed the value expanded.
"""

from __future__ import annotations

import itertools
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.plugins import wait_for

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."
PATIENCE = 30  # seconds; each answer takes well under 1 s (docs/reliability.md)


def alias_bomb(levels: int = 7) -> str:
    names = "abcdefghij"[:levels]
    parts = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&{cur} [" + ", ".join([f"*{prev}"] * 9) + "]" for prev, cur in itertools.pairwise(names)]
    return "timeouts: {add: [" + ", ".join(parts) + "]}\n"


def make_bad(path: Path, kind: str) -> str:
    """Make `path` a bad file of `kind`; the words its error must carry."""
    if kind == "fifo":
        os.mkfifo(path)
        return "not a regular file (a FIFO)"
    if kind == "oversize":
        path.write_text("# padding\n" * 120_000)  # 1.2 MB of comments
        return "larger than 1048576 bytes"
    path.write_text(alias_bomb())
    return "more than 10000 values once its aliases are expanded"


def limited() -> None:
    """A test run on main must not take the machine's memory with it."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def cni_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cni_agent", *args], capture_output=True,
                          text=True, timeout=PATIENCE, preexec_fn=limited)


KINDS = ["fifo", "oversize", "alias-bomb"]


@pytest.mark.parametrize("kind", KINDS)
def test_config_check_and_start_up_name_a_bad_drop_in_at_once(tmp_path: Path, kind: str) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"conf_dir: {tmp_path / 'net.d'}\nstate_dir: {tmp_path / 'state'}\n"
                      f"runtime_dir: {tmp_path / 'run'}\n")
    (tmp_path / "agent.yaml.d").mkdir()
    bad = tmp_path / "agent.yaml.d" / "50-bad.yaml"
    words = make_bad(bad, kind)
    for args in (("config", "check"), ("run",)):
        out = cni_agent(*args, "--config", str(config))
        assert out.returncode == 2, out
        assert f"{bad}: {words}" in out.stderr, out.stderr
        assert len(out.stderr) < 1000, out.stderr[:1000]  # a short value, not the expansion


@pytest.mark.parametrize("kind", KINDS)
def test_reload_names_a_bad_drop_in_and_changes_nothing(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str, kind: str,
) -> None:
    testnet()
    agent = make_agent()
    dropins = Path(f"{agent.config_path}.d")
    dropins.mkdir()
    words = make_bad(dropins / "50-bad.yaml", kind)
    out = agent.gdbus("Reload", timeout=PATIENCE)
    assert f"{ERR}InvalidArgument" in out.stderr and words in out.stderr, out.stderr
    assert len(out.stderr) < 1000
    assert agent.prop("NetworkReady") is True
    agent.setup("after", netns)  # still serving, on the configuration it had


@pytest.mark.parametrize("kind", ["fifo", "oversize"])
def test_a_bad_network_file_is_skipped_and_named_and_scans_go_on(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path, kind: str,
) -> None:
    testnet("good", "50-good.conflist")
    agent = make_agent()
    conf = tmp_path / "net.d"
    bad = conf / "10-bad.conflist"
    if kind == "fifo":
        os.mkfifo(bad)
        words = "not a regular file (a FIFO)"
    else:
        bad.write_bytes(b" " * (1024 * 1024 + 1))
        words = "larger than 1048576 bytes"
    wait_for(lambda: f"{bad}: {words}" in agent.prop("Status"), timeout=PATIENCE)
    assert agent.prop("NetworkReady") is True and agent.prop("DefaultNetwork") == "good"
    assert f"network configuration {bad} skipped: {words}" in agent.log()
    # Later scans still happen: a new network is seen.
    testnet("second", "60-second.conflist")
    wait_for(lambda: "second" in agent.prop("Networks"), timeout=PATIENCE)
    # And `config check` names it too, at once.
    out = cni_agent("config", "check", "--config", str(agent.config_path))
    assert out.returncode == 1 and f"{bad}: {words}" in out.stdout + out.stderr, out
