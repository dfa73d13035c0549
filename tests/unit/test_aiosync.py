"""The kernel's asynchronous fdatasync (node/aiosync.py): its eventfd is
watched from the first batch on, its buffers made once, and neither changes
what a batch reports."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from cni_agent.node.aiosync import _MAX, KernelSync


def _kernel() -> KernelSync:
    kernel = KernelSync.create()
    if kernel is None:
        pytest.skip("no Linux AIO fdatasync here")
    return kernel


async def _sync(kernel: KernelSync, paths: list[str], dir_fd: int = -1) -> BaseException | None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    assert kernel.submit(paths, dir_fd, outcome.set_result)
    return await outcome


async def test_batches_one_after_another_each_report_their_outcome(tmp_path: Path) -> None:
    kernel = _kernel()
    paths = []
    for i in range(3):
        (tmp_path / str(i)).write_bytes(b"x")
        paths.append(str(tmp_path / str(i)))
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for n in range(20):
            assert await _sync(kernel, paths[: n % 3 + 1], dir_fd if n % 2 else -1) is None
        os.eventfd_write(kernel._efd, 1)  # a count with no batch in flight: drained
        await asyncio.sleep(0)
        assert await _sync(kernel, paths) is None
        assert await _sync(kernel, [str(tmp_path / "gone")]) is None  # nothing to sync
    finally:
        kernel.close()
        os.close(dir_fd)


def test_a_second_loop_watches_the_eventfd_in_turn(tmp_path: Path) -> None:
    kernel = _kernel()
    (tmp_path / "f").write_bytes(b"x")
    try:
        for _ in range(2):  # the first loop is closed by the time the second runs
            assert asyncio.run(_sync(kernel, [str(tmp_path / "f")])) is None
    finally:
        kernel.close()


async def test_close_waits_for_a_batch_in_flight(tmp_path: Path) -> None:
    kernel = _kernel()
    (tmp_path / "f").write_bytes(b"x")
    told: list[BaseException | None] = []
    assert kernel.submit([str(tmp_path / "f")], -1, told.append)
    kernel.close()
    assert kernel._left <= 0 and kernel._fds == [] and told == []


async def test_a_batch_larger_than_the_context_holds_is_left_to_the_caller(tmp_path: Path) -> None:
    """More files than the kernel context takes at once: refused whole before
    any is opened (the journal's thread then syncs them), nothing half
    submitted and nothing reported; a batch that fits still goes."""
    kernel = _kernel()
    paths = []
    for i in range(_MAX + 1):
        (tmp_path / str(i)).write_bytes(b"x")
        paths.append(str(tmp_path / str(i)))
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    open_before = len(os.listdir("/proc/self/fd"))
    told: list[BaseException | None] = []
    try:
        assert kernel.submit(paths, -1, told.append) is False
        assert kernel.submit(paths[:_MAX], dir_fd, told.append) is False  # the directory too
        assert told == [] and kernel._fds == [] and kernel._left == 0
        assert len(os.listdir("/proc/self/fd")) == open_before
        assert await _sync(kernel, paths[:_MAX]) is None
    finally:
        kernel.close()
        os.close(dir_fd)
