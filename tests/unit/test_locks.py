"""Per-sandbox locks (in-process FIFO, cross-process flock) and the GC RW lock."""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

import cni_agent.node.locks as locks_module
from cni_agent.node.locks import LockTimeout, NetworkLocks, SandboxLocks

AGENT_DIR = str(Path(locks_module.__file__).resolve().parents[1])


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    return tmp_path / "run" / "locks"


@pytest.fixture
def locks(lock_dir: Path) -> SandboxLocks:
    return SandboxLocks(str(lock_dir))


async def eventually(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5.0
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def wait(aw: Awaitable[object]) -> None:
    await asyncio.wait_for(aw, 5.0)


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def mode(d: Path) -> int | None:
    return d.stat().st_mode & 0o777 if d.exists() else None


def plant(lock_dir: Path, name: str, symlink_to: Path | None = None) -> None:
    """Put a file (or a symlink) where a lock file would go."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    if symlink_to is not None:
        (lock_dir / name).symlink_to(symlink_to)
    else:
        (lock_dir / name).write_text("")


def assert_clean(locks: SandboxLocks, lock_dir: Path) -> None:
    assert locks._queues == {}  # bookkeeping dropped with the last user of an id
    assert locks.held() == []
    assert not lock_dir.exists() or list(lock_dir.iterdir()) == []


# --- in-process behaviour ----------------------------------------------------------


async def test_exclusion_within_process(locks: SandboxLocks, lock_dir: Path) -> None:
    inside = 0
    peak = 0

    async def user() -> None:
        nonlocal inside, peak
        for _ in range(5):
            async with locks.hold("abc", 5):
                inside += 1
                peak = max(peak, inside)
                assert locks.held() == ["abc"]
                assert (lock_dir / "abc.lock").exists()
                await asyncio.sleep(0.001)
                inside -= 1

    await wait(asyncio.gather(*(user() for _ in range(5))))
    assert peak == 1
    assert_clean(locks, lock_dir)


async def test_fifo_order_of_20_waiters(locks: SandboxLocks, lock_dir: Path) -> None:
    arrived: list[int] = []
    acquired: list[int] = []
    release = asyncio.Event()

    async def waiter(i: int) -> None:
        arrived.append(i)
        async with locks.hold("abc", 5):  # enqueues before its first await
            acquired.append(i)
            for _ in range(3):  # give later arrivals every chance to overtake
                await asyncio.sleep(0)

    async def first() -> None:
        async with locks.hold("abc", 5):
            await release.wait()

    head = asyncio.create_task(first())
    await eventually(lambda: locks.held() == ["abc"])
    tasks = []
    for i in random.Random(7).sample(range(20), 20):
        tasks.append(asyncio.create_task(waiter(i)))
        if i % 3 == 0:
            await asyncio.sleep(0)
    await eventually(lambda: len(arrived) == 20)
    release.set()
    await wait(asyncio.gather(head, *tasks))
    assert acquired == arrived
    assert_clean(locks, lock_dir)


async def test_late_arrival_never_overtakes_an_earlier_waiter(locks: SandboxLocks) -> None:
    order: list[str] = []

    async def holder() -> None:
        async with locks.hold("abc", 5):
            order.append("first")
            await eventually(lambda: len(locks._queues["abc"]) == 2)
        # The lock is free now, but "del" has been waiting: this late ADD queues.
        async with locks.hold("abc", 5):
            order.append("late-add")

    async def earlier_del() -> None:
        async with locks.hold("abc", 5):
            order.append("del")
            await asyncio.sleep(0.01)

    h = asyncio.create_task(holder())
    await eventually(lambda: order == ["first"])
    await wait(asyncio.gather(h, earlier_del()))
    assert order == ["first", "del", "late-add"]


async def test_timed_out_waiter_leaves_the_queue_intact(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    release = asyncio.Event()
    got: list[str] = []

    async def holder() -> None:
        async with locks.hold("abc", 5):
            await release.wait()

    async def patient() -> None:
        async with locks.hold("abc", 5):
            got.append("patient")

    h = asyncio.create_task(holder())
    await eventually(lambda: locks.held() == ["abc"])
    impatient_start = time.monotonic()
    with pytest.raises(LockTimeout) as e:
        async with locks.hold("abc", 0.1):
            pytest.fail("acquired a held lock")
    # At least its timeout; and it gave up (the holder never lets go): the
    # upper bound only needs to be finite, and generous on a loaded machine.
    assert 0.09 <= time.monotonic() - impatient_start < 10
    assert e.value.key == "abc" and e.value.timeout == 0.1
    assert str(e.value) == "sandbox abc is busy: lock not acquired within 0.1s"
    p = asyncio.create_task(patient())
    with pytest.raises(LockTimeout):  # a second one, queued behind "patient"
        async with locks.hold("abc", 0.05):
            pass
    assert len(locks._queues["abc"]) == 2
    release.set()
    await wait(asyncio.gather(h, p))
    assert got == ["patient"]
    assert_clean(locks, lock_dir)


async def test_cancelling_a_waiter_mid_queue(locks: SandboxLocks, lock_dir: Path) -> None:
    release = asyncio.Event()
    order: list[str] = []

    async def user(name: str) -> None:
        async with locks.hold("abc", 5):
            order.append(name)
            if name == "a":
                await release.wait()

    a = asyncio.create_task(user("a"))
    await eventually(lambda: order == ["a"])
    b, c, d = (asyncio.create_task(user(n)) for n in "bcd")
    await eventually(lambda: len(locks._queues["abc"]) == 4)
    c.cancel()
    await asyncio.gather(c, return_exceptions=True)
    assert c.cancelled() and len(locks._queues["abc"]) == 3
    release.set()
    await wait(asyncio.gather(a, b, d))
    assert order == ["a", "b", "d"]
    assert_clean(locks, lock_dir)


@pytest.mark.parametrize("when", ["before-handover", "after-handover"])
async def test_cancelling_the_next_in_line_hands_over(
    locks: SandboxLocks, lock_dir: Path, when: str
) -> None:
    release = asyncio.Event()
    order: list[str] = []
    tasks: dict[str, asyncio.Task[None]] = {}

    async def user(name: str) -> None:
        async with locks.hold("abc", 5):
            order.append(name)
            if name == "a":
                await release.wait()
                if when == "before-handover":
                    tasks["b"].cancel()
        if name == "a" and when == "after-handover":
            tasks["b"].cancel()  # b was handed the lock but has not run yet

    for name in "abc":
        tasks[name] = asyncio.create_task(user(name))
        await asyncio.sleep(0)
    await eventually(lambda: len(locks._queues["abc"]) == 3)
    release.set()
    await wait(asyncio.gather(*tasks.values(), return_exceptions=True))
    assert tasks["b"].cancelled()
    assert order == ["a", "c"]
    assert_clean(locks, lock_dir)


async def test_different_ids_do_not_block_each_other(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    async with locks.hold("a", 5):
        async with locks.hold("b", 0.5):
            assert locks.held() == ["a", "b"]
            assert names(lock_dir) == ["a.lock", "b.lock"]
    assert_clean(locks, lock_dir)


async def test_soak_leaves_no_files_and_no_bookkeeping(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    rng = random.Random(42)
    inside: dict[str, int] = {}

    async def user(sid: str, limit: float) -> None:
        async with locks.hold(sid, limit):
            inside[sid] = inside.get(sid, 0) + 1
            try:
                assert inside[sid] == 1
                await asyncio.sleep(rng.random() * 0.003)
            finally:
                inside[sid] -= 1

    tasks = [
        asyncio.create_task(user(f"sb{rng.randrange(8)}", rng.choice([0.0, 0.01, 5.0])))
        for _ in range(300)
    ]
    await asyncio.sleep(0.01)
    for t in rng.sample(tasks, 40):
        t.cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 8)
    for r in results:
        assert r is None or isinstance(r, LockTimeout | asyncio.CancelledError), r
    assert_clean(locks, lock_dir)


async def test_event_loop_stays_responsive_and_lock_dir_is_private(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    assert mode(lock_dir) is None  # created lazily
    async with locks.hold("abc", 5):
        assert mode(lock_dir) == 0o700
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        with pytest.raises(LockTimeout):
            async with locks.hold("abc", 0.3):
                pass
        t.cancel()
        assert ticks >= 5


# --- path safety ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["../x", "a/b", "", ".", "..", "/etc/passwd", "a\x00b", "x" * 201, "é" * 101]
)
async def test_unsafe_ids_are_rejected(
    locks: SandboxLocks, tmp_path: Path, bad: str
) -> None:
    with pytest.raises(ValueError):
        async with locks.hold(bad, 1):
            pytest.fail("held an unsafe id")
    assert names(tmp_path) == []  # not even lock_dir
    assert locks._queues == {}


@pytest.mark.parametrize("odd", [".hidden", "..x", "a..b", "-x", "x" * 200, "é" * 100])
async def test_odd_but_safe_ids_stay_inside_lock_dir(
    locks: SandboxLocks, lock_dir: Path, tmp_path: Path, odd: str
) -> None:
    async with locks.hold(odd, 1):
        assert names(lock_dir) == [odd + ".lock"]
        assert names(tmp_path) == ["run"]
    assert_clean(locks, lock_dir)


async def test_symlink_at_lock_path_is_not_followed(
    locks: SandboxLocks, lock_dir: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    plant(lock_dir, "abc.lock", symlink_to=target)
    with pytest.raises(OSError):
        async with locks.hold("abc", 1):
            pytest.fail("locked through a symlink")
    assert names(tmp_path) == ["run"]  # the target was not created
    assert locks._queues == {} and locks.held() == []


async def test_stale_lock_file_is_taken_over_and_removed(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    plant(lock_dir, "abc.lock")  # left by a crashed holder: not locked
    async with locks.hold("abc", 0.5):
        pass
    assert_clean(locks, lock_dir)


# --- across processes ----------------------------------------------------------------

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


@asynccontextmanager
async def child_holds(path: Path) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A child process holding flock(path) until the yielded release() is awaited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(path),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdin = proc.stdin
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"locked\n"

        async def release() -> None:
            stdin.write(b"\n")
            await stdin.drain()
            await asyncio.wait_for(proc.wait(), 5)

        yield release
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_waits_for_another_process_then_acquires(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    async with child_holds(lock_dir / "abc.lock") as release:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async def take() -> None:
            async with locks.hold("abc", 5):
                assert locks.held() == ["abc"]

        t = asyncio.create_task(ticker())
        taker = asyncio.create_task(take())
        await eventually(lambda: ticks >= 5)  # the loop runs: polling, not blocking it
        assert not taker.done()
        await release()
        await wait(taker)
        t.cancel()
    assert_clean(locks, lock_dir)


async def test_another_process_holding_times_out(
    locks: SandboxLocks, lock_dir: Path
) -> None:
    async with child_holds(lock_dir / "abc.lock") as release:
        got: list[str] = []

        async def patient() -> None:
            async with locks.hold("abc", 5):
                got.append("patient")

        start = time.monotonic()
        impatient = asyncio.create_task(locks.hold("abc", 0.2).__aenter__())
        await asyncio.sleep(0)
        p = asyncio.create_task(patient())  # queued behind the polling head
        with pytest.raises(LockTimeout) as e:
            await impatient
        assert 0.19 <= time.monotonic() - start < 10  # its timeout, and it gave up
        assert e.value.key == "abc" and e.value.timeout == 0.2
        await asyncio.sleep(0.05)
        assert not p.done()  # now the head, polling in turn
        await release()
        await wait(p)
        assert got == ["patient"]
    assert_clean(locks, lock_dir)


SOAK = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from cni_agent.node.locks import SandboxLocks

async def main():
    locks = SandboxLocks(sys.argv[2])
    for _ in range(int(sys.argv[4])):
        async with locks.hold("soak", 30):
            with open(sys.argv[3]) as f:
                n = int(f.read())
            await asyncio.sleep(0.001)
            with open(sys.argv[3], "w") as f:
                f.write(str(n + 1))

asyncio.run(main())
"""


async def test_processes_exclude_each_other_and_leave_no_files(
    locks: SandboxLocks, lock_dir: Path, tmp_path: Path
) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    rounds = 25

    async def in_process() -> None:
        for _ in range(rounds):
            async with locks.hold("soak", 30):
                n = int(counter.read_text())
                await asyncio.sleep(0.001)
                counter.write_text(str(n + 1))

    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", SOAK, AGENT_DIR, str(lock_dir), str(counter), str(rounds)
        )
        for _ in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(in_process(), in_process()), 8)
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 8)
    assert codes == [0, 0]
    assert int(counter.read_text()) == 4 * rounds
    assert_clean(locks, lock_dir)
    assert os.listdir(lock_dir) == []



# The unlink-while-holding and inode-check protocol, at its two racy moments.


def flock_now(path: Path) -> int:
    """Another process's fd holding `path` (flock is per open file, so a 2nd fd will do)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def leave(path: Path, fd: int) -> None:
    """A holder leaving by the protocol: unlink, then release."""
    os.unlink(path)
    os.close(fd)


async def test_a_lock_file_replaced_after_open_is_not_trusted(
    locks: SandboxLocks, lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = lock_dir / "abc.lock"
    plant(lock_dir, "abc.lock")
    holder = flock_now(path)
    newcomer: list[int] = []

    def racing_flock(fd: int, op: int) -> None:
        # Between our open() and flock(), the holder leaves and another process
        # takes a fresh file at the path: locking the old inode proves nothing.
        if not newcomer:
            leave(path, holder)
            newcomer.append(flock_now(path))
        fcntl.flock(fd, op)

    fake = SimpleNamespace(flock=racing_flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB)
    monkeypatch.setattr(locks_module, "fcntl", fake)
    with pytest.raises(LockTimeout):
        async with locks.hold("abc", 0.2):
            pytest.fail("held alongside the process that has the file at the path")
    leave(path, newcomer[0])
    async with locks.hold("abc", 1):
        assert names(lock_dir) == ["abc.lock"]
    assert_clean(locks, lock_dir)


async def test_the_lock_file_is_unlinked_while_still_held(
    locks: SandboxLocks, lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(lock_dir / "abc.lock")
    at_unlink: list[str] = []
    real_unlink = os.unlink

    def spy(target: str, *, dir_fd: int | None = None) -> None:
        if target == path:  # could a contender lock the file we are unlinking?
            fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                at_unlink.append("free")
            except BlockingIOError:
                at_unlink.append("held")
            finally:
                os.close(fd)
        real_unlink(target, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", spy)
    async with locks.hold("abc", 1):
        pass
    monkeypatch.undo()
    assert at_unlink == ["held"]
    assert_clean(locks, lock_dir)

# --- per-network exclusion for the GC verb ------------------------------------------


async def test_chains_of_one_network_share_it() -> None:
    nl = NetworkLocks()
    both = asyncio.Barrier(2)

    async def chain() -> None:
        async with nl.use("pods", 1):
            await asyncio.wait_for(both.wait(), 1)  # both inside at once

    await wait(asyncio.gather(chain(), chain()))
    assert not nl.busy("pods")


async def test_waiting_gc_never_delays_a_chain() -> None:
    nl = NetworkLocks()
    release = asyncio.Event()
    order: list[str] = []

    async def slow_add() -> None:
        async with nl.use("pods", 1):
            await release.wait()
        order.append("slow add done")

    async def gc() -> None:
        async with nl.exclusive("pods", 5):
            order.append("gc")

    slow = asyncio.create_task(slow_add())
    await asyncio.sleep(0)
    pending_gc = asyncio.create_task(gc())
    await asyncio.sleep(0.01)
    # A new chain on the same network, while the GC waits: in at once.
    async with nl.use("pods", 0):
        order.append("new chain")
    release.set()
    await wait(asyncio.gather(slow, pending_gc))
    assert order == ["new chain", "slow add done", "gc"]
    assert not nl.busy("pods")


async def test_gc_gives_up_when_no_quiet_instant_comes() -> None:
    nl = NetworkLocks()
    stop = asyncio.Event()
    waited: list[float] = []

    async def stream() -> None:
        chains: list[asyncio.Task[None]] = []

        async def one() -> None:
            start = time.monotonic()
            async with nl.use("pods", 5):
                waited.append(time.monotonic() - start)
                await asyncio.sleep(0.02)  # chains overlap: never idle

        while not stop.is_set():
            chains.append(asyncio.create_task(one()))
            await asyncio.sleep(0.005)
        await asyncio.gather(*chains)

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.03)
    with pytest.raises(LockTimeout) as e:
        async with nl.exclusive("pods", 0.2):
            pytest.fail("GC ran while chains were in flight")
    assert str(e.value) == "network pods is busy: lock not acquired within 0.2s"
    stop.set()
    await wait(task)
    assert max(waited) < 0.01  # no chain ever waited for the GC
    assert not nl.busy("pods")


async def test_running_gc_holds_new_chains_of_its_network_only() -> None:
    nl = NetworkLocks()
    release = asyncio.Event()
    entered = asyncio.Event()

    async def gc() -> None:
        async with nl.exclusive("pods", 1):
            entered.set()
            await release.wait()

    task = asyncio.create_task(gc())
    await entered.wait()
    async with nl.use("other", 0):  # another network: unaffected
        pass
    with pytest.raises(LockTimeout) as e:
        async with nl.use("pods", 0.05):
            pass
    assert "network pods (its GC is running)" in str(e.value)
    waiting = asyncio.create_task(_use(nl, "pods"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    release.set()
    await wait(asyncio.gather(task, waiting))
    assert not nl.busy("pods")


async def _use(nl: NetworkLocks, name: str) -> None:
    async with nl.use(name, 5):
        pass


async def test_cancelled_waiters_leave_no_state() -> None:
    nl = NetworkLocks()
    release = asyncio.Event()

    async def chain() -> None:
        async with nl.use("pods", 5):
            await release.wait()

    c = asyncio.create_task(chain())
    await asyncio.sleep(0)
    g = asyncio.create_task(nl.exclusive("pods", 5).__aenter__())
    await asyncio.sleep(0.01)
    g.cancel()
    await asyncio.gather(g, return_exceptions=True)
    release.set()
    await wait(c)
    assert not nl.busy("pods")
    async with nl.exclusive("pods", 0):  # free: a zero timeout still acquires
        pass


async def test_sweep_removes_only_unheld_lock_files(tmp_path: Path) -> None:
    import subprocess

    locks = SandboxLocks(str(tmp_path))
    (tmp_path / "stale.lock").write_text("")
    (tmp_path / "other.txt").write_text("")
    holder = subprocess.Popen(["flock", str(tmp_path / "held.lock"), "sleep", "30"])
    try:
        for _ in range(200):
            if (tmp_path / "held.lock").exists():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        async with locks.hold("mine", 5):
            assert locks.sweep() == ["stale"]
            assert (tmp_path / "mine.lock").exists()
        assert (tmp_path / "held.lock").exists()
        assert (tmp_path / "other.txt").exists()
        assert not (tmp_path / "stale.lock").exists()
    finally:
        holder.kill()
        holder.wait()
