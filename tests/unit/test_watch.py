"""DirWatcher against real inotify in tmp_path: no root, no mocks of the kernel."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from cni_agent.node import watch as watch_mod
from cni_agent.node.watch import DirWatcher

DEBOUNCE = 0.01


class Recorder:
    """Collects on_change reasons; `wait` returns the next one matching."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.errors: list[str] = []
        self._seen = 0
        self._event = asyncio.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self._event.set()

    def error(self, message: str) -> None:
        self.errors.append(message)
        self._event.set()

    async def wait_error(self) -> str:
        async with asyncio.timeout(2.0):
            while not self.errors:
                self._event.clear()
                await self._event.wait()
        return self.errors[0]

    async def wait(self, match: str = "", limit: float = 2.0) -> str:
        async with asyncio.timeout(limit):
            while True:
                for i in range(self._seen, len(self.reasons)):
                    if match in self.reasons[i]:
                        self._seen = i + 1
                        return self.reasons[i]
                self._seen = len(self.reasons)
                self._event.clear()
                await self._event.wait()

    async def settle(self, period: float = 0.1) -> None:
        """Let pending events fire, then forget them."""
        await asyncio.sleep(period)
        self._seen = len(self.reasons)


Factory = Callable[..., Awaitable[tuple[DirWatcher, Recorder]]]


@pytest.fixture
async def make_watcher() -> AsyncIterator[Factory]:
    made: list[DirWatcher] = []

    async def make(
        *paths: Path, start: bool = True, debounce: float = DEBOUNCE
    ) -> tuple[DirWatcher, Recorder]:
        rec = Recorder()
        w = DirWatcher([str(p) for p in paths], rec, rec.error, debounce=debounce)
        made.append(w)
        if start:
            await w.start()
        return w, rec

    yield make
    for w in made:
        await w.stop()


def write(path: Path, text: str = "{}") -> None:
    path.write_text(text)


async def test_config_created_replaced_removed(tmp_path: Path, make_watcher: Factory) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    w, rec = await make_watcher(conf)
    assert w.healthy
    write(conf / "10-x.conflist")
    assert "10-x.conflist created" in await rec.wait("10-x.conflist")
    write(conf / ".20-y.tmp")
    await rec.settle()
    os.replace(conf / ".20-y.tmp", conf / "20-y.conflist")  # atomic replace
    assert await rec.wait("20-y.conflist moved in")
    (conf / "10-x.conflist").unlink()
    assert await rec.wait("10-x.conflist removed")
    assert rec.errors == []


@pytest.mark.parametrize("stepwise", [False, True])
async def test_dirs_missing_at_start(tmp_path: Path, make_watcher: Factory, stepwise: bool) -> None:
    bindir = tmp_path / "opt" / "cni" / "bin"  # opt and opt/cni missing too
    w, rec = await make_watcher(bindir)
    assert w.healthy
    if stepwise:
        for d in (tmp_path / "opt", tmp_path / "opt" / "cni", bindir):
            d.mkdir()
            await rec.wait(str(d))
    else:
        bindir.mkdir(parents=True)
        await rec.wait()
    write(bindir / "bridge")
    assert await rec.wait(f"{bindir}: bridge created")


async def test_rmtree_and_recreate_repeatedly(tmp_path: Path, make_watcher: Factory) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    _, rec = await make_watcher(conf)
    for i in range(20):
        shutil.rmtree(conf)
        conf.mkdir()
        await rec.wait()  # the re-arm reports a change (files may have been missed)
        write(conf / f"{i}.conflist")
        # Reported as an event inside the new directory: the watch was re-added.
        assert await rec.wait(f"{conf}: {i}.conflist created")
    assert rec.errors == []


async def test_moved_away_and_back(tmp_path: Path, make_watcher: Factory) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    _, rec = await make_watcher(conf)
    conf.rename(tmp_path / "net.d.old")
    await rec.wait("net.d moved out")
    write(tmp_path / "net.d.old" / "ignored.conf")
    (tmp_path / "net.d.old").rename(conf)
    await rec.wait("net.d moved in")
    write(conf / "back.conf")
    assert await rec.wait(f"{conf}: back.conf created")


async def test_dir_replaced_by_symlink(tmp_path: Path, make_watcher: Factory) -> None:
    bindir, other = tmp_path / "bin", tmp_path / "other"
    bindir.mkdir()
    other.mkdir()
    _, rec = await make_watcher(bindir)
    shutil.rmtree(bindir)
    bindir.symlink_to(other)
    await rec.wait()  # the swap is seen in the parent
    write(other / "plugin")
    assert await rec.wait(f"{bindir}: plugin created")
    # The symlink's target itself removed and re-created: the link is unchanged.
    shutil.rmtree(other)
    await rec.wait()
    other.mkdir()
    await rec.wait("other created")
    write(other / "plugin2")
    assert await rec.wait(f"{bindir}: plugin2 created")


async def test_chmod_fires(tmp_path: Path, make_watcher: Factory) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write(bindir / "plugin")
    _, rec = await make_watcher(bindir)
    os.chmod(bindir / "plugin", 0o755)
    assert await rec.wait("plugin attributes changed")


async def test_debounce_coalesces_burst(tmp_path: Path, make_watcher: Factory) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    _, rec = await make_watcher(conf, debounce=0.03)  # the default
    for i in range(50):
        write(conf / f"{i}.conf")
        await asyncio.sleep(0.002)  # a burst spread over several debounce windows
    await rec.settle()
    assert 1 <= len(rec.reasons) < 10, rec.reasons
    assert "(+" in rec.reasons[0]  # several distinct events summarised


async def test_stop_closes_fd_and_leaves_no_tasks(tmp_path: Path) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    baseline = len(os.listdir("/proc/self/fd"))
    rec = Recorder()
    w = DirWatcher([str(conf), str(tmp_path / "missing" / "bin")], rec, debounce=DEBOUNCE)
    await w.start()
    assert len(os.listdir("/proc/self/fd")) == baseline + 1
    write(conf / "a.conf")  # leaves a debounce timer pending
    await asyncio.sleep(0)
    await w.stop()
    await w.stop()  # idempotent
    assert len(os.listdir("/proc/self/fd")) == baseline
    assert asyncio.all_tasks() == {asyncio.current_task()}
    write(conf / "b.conf")
    await asyncio.sleep(0.1)
    assert rec.reasons == []


async def test_init_failure_reported_then_recovers(
    tmp_path: Path, make_watcher: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()

    def broken() -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(watch_mod._pyinotify, "WatchManager", broken)
    w, rec = await make_watcher(conf, start=False)
    w.retry_interval = 0.05
    await w.start()
    assert not w.healthy
    assert "inotify init failed" in rec.errors[0]
    monkeypatch.undo()
    assert "restored" in await rec.wait()
    assert w.healthy
    write(conf / "a.conf")
    assert await rec.wait("a.conf created")


async def test_read_error_reported_then_recovers(
    tmp_path: Path, make_watcher: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "net.d"
    conf.mkdir()
    w, rec = await make_watcher(conf)
    w.retry_interval = 0.05

    def broken(self: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(watch_mod._pyinotify.Notifier, "read_events", broken)
    write(conf / "a.conf")
    assert "inotify read failed" in await rec.wait_error()
    assert not w.healthy
    monkeypatch.undo()
    assert "restored" in await rec.wait()
    assert w.healthy
    write(conf / "b.conf")
    assert await rec.wait("b.conf created")
