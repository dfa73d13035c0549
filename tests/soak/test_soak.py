"""Short versions of the soak runs (`make soak` runs the long ones)."""

from __future__ import annotations

import pytest

from tests.soak.harness import crashes, gc_and_waiting, power_loss, reboot, soak

pytestmark = pytest.mark.root


def test_short_soak_leaves_nothing() -> None:
    report = soak(ops=300, sandboxes=10, workers=8)
    assert report.operations == 310
    assert dict(report.failures) == {}
    assert report.leaks == []


def test_gc_and_teardowns_of_waiting_setups_leave_nothing() -> None:
    report = gc_and_waiting(ops=200, sandboxes=8, workers=6)
    assert dict(report.failures) == {}
    assert report.leaks == []


def test_kill_9_mid_operation_leaves_every_sandbox_whole_or_gone() -> None:
    report = crashes(kills=5, sandboxes=6)
    assert report.leaks == []


def test_reboot_reaps_stale_attachments_and_releases_ips() -> None:
    report = reboot(sandboxes=6)
    assert dict(report.failures) == {}
    assert report.leaks == []


def test_power_loss_damage_never_blocks_a_teardown_nor_leaks() -> None:
    report = power_loss(kills=4, sandboxes=6)
    assert dict(report.failures) == {}
    assert report.leaks == []
