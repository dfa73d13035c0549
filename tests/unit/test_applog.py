"""The journal's append-only log: what survives, what a power cut leaves, and
what one group commit covers (node/applog.py).

Real files in a temp dir; a full disk is a real tmpfs (root only)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cni_agent.node import applog
from cni_agent.node.applog import AppendLog, frame, lines_of


def _open(tmp: Path) -> tuple[AppendLog, applog.Replay]:
    return AppendLog.open(str(tmp / "journal"), str(tmp / "damaged"))


def _segments(tmp: Path) -> list[str]:
    return sorted(p.name for p in (tmp / "journal").iterdir())


def test_lines_survive_a_reopen_in_order(tmp_path: Path) -> None:
    log, replay = _open(tmp_path)
    assert replay.payloads == []
    for i in range(5):
        log.append(b'{"n":%d}' % i)
    log.close()  # no commit: a killed agent's lines are in the page cache all the same
    again, replay = _open(tmp_path)
    assert replay.payloads == [b'{"n":%d}' % i for i in range(5)] and replay.problems == []
    again.close()


@pytest.mark.parametrize("tail", [b"0000", b"\0" * 4096, frame(b'{"n":9}')[:-3]],
                         ids=["torn", "zeroed page", "no newline"])
def test_a_damaged_tail_is_dropped_kept_aside_and_never_appended_after(
    tmp_path: Path, tail: bytes,
) -> None:
    log, _ = _open(tmp_path)
    log.append(b'{"n":1}')
    log.close()
    [segment] = _segments(tmp_path)
    with open(tmp_path / "journal" / segment, "ab") as f:
        f.write(tail)  # what a power cut leaves of lines never committed
    log, replay = _open(tmp_path)
    assert replay.payloads == [b'{"n":1}']
    assert len(replay.problems) == 1 and "dropped" in replay.problems[0]
    [kept] = (tmp_path / "damaged").iterdir()
    assert kept.read_bytes() == tail
    # Appends go to a new segment, not after the damage: the next replay is clean.
    log.append(b'{"n":2}')
    log.close()
    assert len(_segments(tmp_path)) == 2
    log, replay = _open(tmp_path)
    assert replay.payloads == [b'{"n":1}', b'{"n":2}']
    log.close()


def test_a_bad_line_in_the_middle_costs_only_itself(tmp_path: Path) -> None:
    data = frame(b"a") + b"deadbeef b\n" + frame(b"c")
    good, bad = lines_of(data)
    assert good == [b"a", b"c"] and bad == [(len(frame(b"a")), b"deadbeef b\n")]


async def test_one_sync_commits_everyone_waiting(tmp_path: Path) -> None:
    log, _ = _open(tmp_path)

    async def writer(i: int) -> None:
        log.append(b'{"n":%d}' % i)
        await log.commit()

    await asyncio.gather(*(writer(i) for i in range(20)))
    # The first commit's sync covers the first line; the 19 that arrived
    # meanwhile share the next one.
    assert 1 <= log.syncs <= 3, log.syncs
    before = log.syncs
    await log.commit()  # nothing new: nothing to sync
    assert log.syncs == before
    log.close()


async def test_a_commit_is_durable_by_the_kernel_or_the_journals_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel has no asynchronous fdatasync (Linux AIO), the journal's
    own thread syncs: the same outcome, a commit that returns once synced."""
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(applog.KernelSync, "create", classmethod(lambda cls: None))
        log, _ = _open(tmp_path / str(kernel))
        log.append(b'{"n":1}')
        await log.commit()
        assert log.syncs == 1 and log._synced == 1
        assert isinstance(log._kernel, applog.KernelSync) is kernel
        log.close()


async def test_compaction_keeps_the_state_and_drops_what_it_covers(tmp_path: Path) -> None:
    log, _ = _open(tmp_path)
    for i in range(100):
        log.append(b'{"n":%d}' % i)
    state = [b'{"state":1}', b'{"state":2}']
    await log.compact(lambda: iter(state))
    log.append(b'{"after":1}')
    await log.commit()
    log.close()
    names = _segments(tmp_path)
    assert [n for n in names if n.startswith("snapshot-")] == ["snapshot-00000000"]
    assert "log-00000000" not in names  # covered by the snapshot
    log, replay = _open(tmp_path)
    assert replay.payloads == [*state, b'{"after":1}']
    log.close()


def test_a_snapshot_without_its_trailer_is_not_trusted(tmp_path: Path) -> None:
    log, _ = _open(tmp_path)
    log.append(b'{"n":1}')
    log.close()
    # A snapshot a crash cut short (never renamed into place normally; here by hand).
    (tmp_path / "journal" / "snapshot-00000005").write_bytes(frame(b'{"partial":1}'))
    log, replay = _open(tmp_path)
    assert replay.payloads == [b'{"n":1}']
    assert any("incomplete" in p for p in replay.problems)
    log.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts a tmpfs)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,nr_inodes=64", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.root
def test_an_append_the_disk_refuses_leaves_nothing_of_itself(small_disk: Path) -> None:
    log, _ = _open(small_disk)
    log.append(b'{"n":1}')
    try:
        _fill_and_refuse(log, small_disk)
    finally:
        log.close()
    log, replay = _open(small_disk)
    try:
        assert replay.problems == []  # no half line in the middle
        assert replay.payloads[0] == b'{"n":1}' and replay.payloads[-1] == b'{"n":2}'
    finally:
        log.close()


def _fill_and_refuse(log: AppendLog, small_disk: Path) -> None:
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"x" * 4096)
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        for _ in range(100):  # the segment's last page fills up, then the disk refuses
            log.append(b'{"big":"' + b"y" * 1000 + b'"}')
    filler.unlink()
    log.append(b'{"n":2}')


async def test_a_damaged_line_in_a_snapshot_costs_that_line_only(tmp_path: Path) -> None:
    log, _ = _open(tmp_path)
    await log.compact(lambda: iter([b'{"a":1}', b'{"b":2}', b'{"c":3}']))
    log.close()
    path = tmp_path / "journal" / "snapshot-00000000"
    data = path.read_bytes()
    line = frame(b'{"b":2}')
    path.write_bytes(data.replace(line, b"\0" * (len(line) - 1) + b"\n"))  # outside damage
    log, replay = _open(tmp_path)
    assert replay.payloads == [b'{"a":1}', b'{"c":3}']
    assert any("dropped" in p for p in replay.problems)
    log.close()
