"""`make run` installs what running needs, `make setup`/`make test` the toolchain too."""

from __future__ import annotations

import os
import subprocess

from tests.support.agent import REPO

TOOLCHAIN = {"podman", "runc", "debootstrap", "rpm", "debhelper", "rpm-build", "busybox-static",
             "python3-docutils"}


def planned(*args: str) -> dict[str, list[str]]:
    out = subprocess.run([str(REPO / "tools" / "setup-system"), *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "SETUP_SYSTEM_PRINT": "1"})
    return {k: v.split() for k, _, v in (line.partition(": ") for line in out.stdout.splitlines())}


def test_make_run_asks_for_what_running_needs_and_no_test_tool() -> None:
    run = planned("--run")
    assert run["test tools"] == ["false"]  # no promtool, no containerd fetched
    for manager in ("deb", "rpm"):
        assert not TOOLCHAIN & set(run[manager]), run[manager]
        assert "containernetworking-plugins" in run[manager]
    assert {"dbus-daemon", "iproute2", "libsystemd-dev", "python3-venv"} <= set(run["deb"])
    full = planned()
    assert full["test tools"] == ["true"]
    assert set(run["deb"]) < set(full["deb"]) and {"podman", "debootstrap"} <= set(full["deb"])
    assert set(run["rpm"]) < set(full["rpm"])
    # And make run calls only that: not `make setup`, not the test extras.
    steps = subprocess.run(["make", "-n", "-B", "run"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout
    assert "tools/setup-system --run" in steps
    assert "tools/setup-system\n" not in steps and "[test]" not in steps
