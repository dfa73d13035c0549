"""The bounded off-loop worker for caller paths (issue 12, item 5), with a slow
job standing in for a stat on a hung mount."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.node.blocking import PathsBusy, PathTimeout, PathWorker


async def test_a_stuck_path_times_out_with_a_named_error_and_the_loop_keeps_running() -> None:
    worker = PathWorker(threads=2, timeout=0.1)
    release = threading.Event()
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    with pytest.raises(PathTimeout) as e:
        await worker.run(release.wait, "netns", "/hung/ns")
    ticker.cancel()
    assert e.value.field == "netns"
    assert str(e.value) == "netns: '/hung/ns' did not answer within 0.1s (is it on a hung mount?)"
    assert ticks >= 5  # the loop ran all along
    assert worker.stuck == 1
    release.set()
    await asyncio.sleep(0.05)
    assert worker.stuck == 0
    assert await worker.run(lambda: 42, "netns", "/x") == 42
    worker.stop()


async def test_jobs_that_arrive_together_each_get_a_thread_of_their_own() -> None:
    """Two callers in one loop iteration, one idle thread (issue 36, item 7):
    the second job must start a thread of its own. The idle thread counted as
    idle until it took a job, so both jobs went to it, the second queued behind
    the first hung one: fewer threads got stuck than the bound said, and the
    next hung path was not refused but timed out (test_hung_paths, when the
    machine was busy enough that the thread woke late)."""
    worker = PathWorker(threads=2, timeout=30)
    assert await worker.run(lambda: 1, "netns", "/fine") == 1
    for _ in range(10_000):  # until the thread is back waiting for work
        if worker._idle == 1:
            break
        await asyncio.sleep(0.001)
    release = threading.Event()
    started: list[str] = []
    both = threading.Event()

    def hang(name: str) -> None:
        started.append(name)
        if len(started) == 2:
            both.set()
        release.wait()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1)  # the woken thread cannot run before both jobs are in
    try:
        jobs = [asyncio.ensure_future(worker.run(lambda n=n: hang(n), "netns", n))  # type: ignore[misc]
                for n in "ab"]
        await asyncio.sleep(0)
    finally:
        sys.setswitchinterval(switch)
    try:
        assert await asyncio.to_thread(both.wait, 10), started
    finally:
        release.set()
    assert await asyncio.gather(*jobs) == [None, None]
    worker.stop()


async def test_stuck_threads_are_bounded_and_later_calls_are_refused_at_once() -> None:
    worker = PathWorker(threads=2, timeout=0.1)
    release = threading.Event()
    started: list[str] = []

    def hang(name: str) -> None:
        started.append(name)
        release.wait()

    results = await asyncio.gather(*(worker.run(lambda n=n: hang(n), "netns", n)  # type: ignore[misc]
                                     for n in "abcd"), return_exceptions=True)
    assert all(isinstance(r, PathTimeout) for r in results)
    assert len(started) == 2  # the queued ones never ran
    assert worker.stuck == 2
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(PathsBusy) as e:
        await worker.run(lambda: 1, "netns", "/fine")
    assert loop.time() - t0 < 0.05 and e.value.kind is ErrorKind.BUSY
    assert threading.active_count() <= 2 + 1 + 4  # main, the 2 stuck, and little else
    release.set()
    await asyncio.sleep(0.05)
    assert await worker.run(lambda: "ok", "netns", "/fine") == "ok"
    assert len(started) == 2
    worker.stop()


async def test_a_result_that_comes_after_the_timeout_is_discarded() -> None:
    worker = PathWorker(threads=1, timeout=0.05)
    release = threading.Event()
    freed: list[int] = []

    def slow_open() -> int:
        release.wait()
        return 7

    with pytest.raises(PathTimeout):
        await worker.run(slow_open, "netns", "/slow", discard=freed.append)
    release.set()
    await asyncio.sleep(0.05)
    assert freed == [7]  # e.g. an fd: closed, not leaked
    worker.stop()


async def test_cancellation_frees_a_late_result_too() -> None:
    worker = PathWorker(threads=1, timeout=5)
    started, release = threading.Event(), threading.Event()
    freed: list[int] = []

    def job() -> int:
        started.set()
        release.wait()
        return 9

    task = asyncio.create_task(worker.run(job, "netns", "/x", discard=freed.append))
    # Cancelled once the thread runs it (a job still queued is dropped, never run).
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    for _ in range(500):  # the thread hands its late result over when it gets the CPU
        if freed:
            break
        await asyncio.sleep(0.01)
    assert freed == [9]
    worker.stop()


async def test_errors_of_the_job_pass_through_and_stop_refuses_new_work() -> None:
    worker = PathWorker(threads=1, timeout=1)

    def boom() -> None:
        raise ValueError("bad path")

    with pytest.raises(ValueError, match="bad path"):
        await worker.run(boom, "netns", "/x")
    worker.stop()
    with pytest.raises(AgentError) as e:
        await worker.run(lambda: 1, "netns", "/x")
    assert e.value.kind is ErrorKind.SHUTTING_DOWN
