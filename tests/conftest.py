"""Shared fixtures. Real parts everywhere: real plugins, real namespaces."""

from __future__ import annotations

import fcntl
import itertools
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support.agent import Agent
from tests.support.forkserver import ForkServer
from tests.support.plugins import Control, install_plugin

# `make test` keeps both cores busy (8 workers on 2): a draw may wait its turn
# for the CPU, so how fast inputs are generated says nothing of the code
# under test (one CI run failed the too_slow check: 4 inputs in 1 s).
settings.register_profile("cni-agent", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cni-agent")

_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    # The agents this process starts are forked from one that imported the
    # agent once (tests/support/forkserver.py: a sixth of the suite's CPU);
    # CNI_AGENT_TEST_EXEC=1 execs each, as the benchmarks and packages do.
    if os.environ.get("CNI_AGENT_TEST_EXEC") != "1":
        Agent.fork_server = ForkServer()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root (network namespaces, real plugins)")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@contextmanager
def machine_wide(what: str) -> Iterator[None]:
    """Held while a test uses something the whole machine shares and no unique
    name can separate (the installed package's files, the fallback network's
    bridge): `make test` runs test files in parallel, and the tests that use
    the same such thing must take turns."""
    with open(f"/tmp/cni-agent-tests.{what}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture
def fallback_bridge() -> Iterator[None]:
    """The fallback network's bridge (cniagent0, a fixed name), the test's alone."""
    with machine_wide("cniagent0"):
        yield


def unique_name(prefix: str) -> str:
    """Short unique names (interface names are limited to 15 bytes)."""
    return f"{prefix}{os.getpid() % 10000}x{next(_counter)}"


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    install_plugin(d, "testplug")
    return d


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Control]:
    ctl = Control(tmp_path / "control.json")
    yield ctl
    # Plugins orphaned by a killed agent (hang actions) must not outlive the test.
    for rec in ctl.records(None):
        for pid in (rec.get("pid"), rec.get("child")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    mine = str(tmp_path).encode() in f.read()
                if mine:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, TypeError):
                pass


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh named network namespace; its path under /run/netns."""
    name = unique_name("cat")
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield f"/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def netns_factory() -> Iterator[object]:
    made: list[str] = []

    def make() -> str:
        name = unique_name("cat")
        subprocess.run(["ip", "netns", "add", name], check=True)
        made.append(name)
        return f"/run/netns/{name}"

    yield make
    for name in made:
        subprocess.run(["ip", "netns", "del", name], check=False, stderr=subprocess.DEVNULL)
