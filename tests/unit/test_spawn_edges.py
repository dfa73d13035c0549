"""The edges of the cheaper plugin execution path: stdin written whole or fed,
output read to the byte at a chunk's edge, one environment per invocation with
a token per run, exits watched in one epoll per loop, journal fields entered as
a chain."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
from pathlib import Path

import pytest

from cni_agent.cni import leftovers, spawn
from cni_agent.cni.exec import Invocation, ProcessExecutor
from cni_agent.cni.logctx import ContextFields, log_fields
from tests.support.plugins import shell_plugin

ADD = Invocation("ADD", "c1", "/run/netns/x", "eth0", "A=1", "/usr/lib/cni")


@pytest.mark.parametrize("size", [0, 1, select.PIPE_BUF - 1, select.PIPE_BUF,
                                  select.PIPE_BUF + 1, 65536, 65537, 300_000])
async def test_stdin_of_any_size_arrives_whole(tmp_path: Path, size: int) -> None:
    """Up to PIPE_BUF is written before the spawn on the blocking end; more is fed."""
    binary = shell_plugin(tmp_path, "cat", "cat\n")
    stdin = bytes(i % 251 for i in range(size))
    assert await ProcessExecutor(max_stdout=1 << 20).execute("cat", binary, ADD, stdin, 10) == stdin


@pytest.mark.parametrize("size", [0, 1, 65535, 65536, 65537, 131072, 200_000])
async def test_output_at_a_chunks_edge_is_read_to_the_byte(tmp_path: Path, size: int) -> None:
    """A short read empties the pipe once the plugin is gone; a full one reads on."""
    binary = shell_plugin(tmp_path, "out", f"head -c {size} /dev/zero | tr '\\0' o\n"
                                      f"head -c {size} /dev/zero | tr '\\0' e >&2\nexit 3\n")
    executor = ProcessExecutor(max_stdout=1 << 20, max_stderr=1 << 20)
    child = await executor._spawn("out", binary, ADD, b"{}")
    await asyncio.wait_for(child.finished(), 10)
    assert child.stdout == b"o" * size
    assert child.stderr == b"e" * size
    assert child.reap_now() == 3


async def test_runs_of_one_invocation_share_its_variables_and_each_has_its_token(
        tmp_path: Path) -> None:
    dump = tmp_path / "env"
    binary = shell_plugin(tmp_path, "env", f"env >> {dump}\necho --- >> {dump}\n")
    executor = ProcessExecutor(instance="inst")
    other = Invocation("DEL", "c2", "", "eth1", "", "/opt/cni/bin")
    for inv in (ADD, ADD, other, ADD):
        await executor.execute("env", binary, inv, b"{}", 10)
    runs = [dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
            for block in dump.read_text().split("---\n") if block.strip()]
    assert [r["CNI_COMMAND"] for r in runs] == ["ADD", "ADD", "DEL", "ADD"]
    assert runs[2]["CNI_CONTAINERID"] == "c2" and runs[2]["CNI_IFNAME"] == "eth1"
    assert runs[2]["CNI_NETNS"] == "" and runs[3]["CNI_NETNS"] == "/run/netns/x"
    assert all(r["CNI_AGENT_INSTANCE"] == "inst" for r in runs)
    tokens = [r["CNI_AGENT_RUN"] for r in runs]
    assert len(set(tokens)) == 4 and all(t.startswith(f"{os.getpid()}-") for t in tokens)


async def test_concurrent_runs_each_get_their_own_token(tmp_path: Path) -> None:
    """One environment dict serves a chain; each spawn sets its token first."""
    binary = shell_plugin(tmp_path, "tok", 'sleep 0.05; echo "$CNI_AGENT_RUN"\n')
    executor = ProcessExecutor()
    outs = await asyncio.gather(*(executor.execute("tok", binary, ADD, b"{}", 10)
                                  for _ in range(8)))
    assert len({o.strip() for o in outs}) == 8


async def test_exits_are_seen_on_a_second_loop_and_in_another_thread(tmp_path: Path) -> None:
    binary = shell_plugin(tmp_path, "ok", "echo '{}'\n")
    executor = ProcessExecutor()

    def elsewhere() -> bytes:
        return asyncio.run(executor.execute("ok", binary, ADD, b"{}", 10))

    # A new loop in this thread's place, then loops in two threads at once.
    assert await asyncio.to_thread(elsewhere) == b"{}\n"
    assert await asyncio.to_thread(elsewhere) == b"{}\n"
    # Rounds of it: one loop's sweep once took another's plugin, spawned and not
    # yet registered, for a leftover and killed it (a third of the rounds).
    for _ in range(30):
        four = await asyncio.gather(asyncio.to_thread(elsewhere), asyncio.to_thread(elsewhere),
                                    executor.execute("ok", binary, ADD, b"{}", 10),
                                    executor.execute("ok", binary, ADD, b"{}", 10))
        assert list(four) == [b"{}\n"] * 4


async def test_one_failing_exit_callback_does_not_lose_the_others() -> None:
    """Each reports once (EPOLLONESHOT): a callback that raises must not cost the
    rest of its batch their exit."""
    loop = asyncio.get_running_loop()
    exits = spawn._Exits(loop)
    seen: list[int] = []
    errors: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
    pipes = [os.pipe() for _ in range(3)]
    try:
        def boom() -> None:
            raise RuntimeError("boom")

        exits.watch(pipes[0][0], boom)
        exits.watch(pipes[1][0], lambda: seen.append(1))
        exits.watch(pipes[2][0], lambda: seen.append(2))
        for _, w in pipes:
            os.write(w, b"x")  # readable, as a pidfd is once its process exits
        for _ in range(50):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(seen) == [1, 2]
        assert [str(e) for e in errors] == ["boom"]
    finally:
        loop.set_exception_handler(None)
        loop.remove_reader(exits._epoll.fileno())
        exits._epoll.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_the_remembered_pid_follows_a_fork() -> None:
    pid = os.fork()
    if pid == 0:
        ok = leftovers._pid == os.getpid() and leftovers.Leftovers().token().startswith(
            f"{os.getpid()}-") and not hasattr(spawn._this_thread, "exits")
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert leftovers._pid == os.getpid()


def _fields() -> dict[str, str]:
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "m", None, None)
    ContextFields().filter(record)
    return {k: getattr(record, k) for k in ("SANDBOX_ID", "NETWORK", "IFNAME", "CNI_COMMAND",
                                            "PLUGIN") if hasattr(record, k)}


def test_journal_fields_inner_over_outer_empty_ignored() -> None:
    assert _fields() == {}
    with log_fields(SANDBOX_ID="s1", NETWORK="n1"):
        with log_fields(NETWORK="n2", IFNAME=""):
            with log_fields(PLUGIN="bridge", CNI_COMMAND="ADD", SANDBOX_ID=""):
                assert _fields() == {"SANDBOX_ID": "s1", "NETWORK": "n2", "PLUGIN": "bridge",
                                     "CNI_COMMAND": "ADD"}
            assert _fields() == {"SANDBOX_ID": "s1", "NETWORK": "n2"}
        assert _fields() == {"SANDBOX_ID": "s1", "NETWORK": "n1"}
    assert _fields() == {}


def test_journal_fields_explicit_extra_wins_and_unknown_keys_are_refused() -> None:
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "m", None, None)
    record.NETWORK = "explicit"
    with log_fields(NETWORK="ctx", PLUGIN="p"):
        ContextFields().filter(record)
    assert record.NETWORK == "explicit" and record.PLUGIN == "p"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="BOGUS"):
        log_fields(BOGUS="x")


async def test_journal_fields_stay_with_their_task() -> None:
    """Concurrent tasks never see each other's fields."""
    gate = asyncio.Event()

    async def one(name: str) -> dict[str, str]:
        with log_fields(SANDBOX_ID=name):
            await gate.wait()
            return _fields()

    tasks = [asyncio.create_task(one(f"s{i}")) for i in range(3)]
    await asyncio.sleep(0)
    gate.set()
    assert [t["SANDBOX_ID"] for t in await asyncio.gather(*tasks)] == ["s0", "s1", "s2"]


def test_the_thread_local_exits_is_per_thread() -> None:
    mine: list[object] = []

    async def grab() -> None:
        mine.append(spawn._exits(asyncio.get_running_loop()))

    asyncio.run(grab())
    t = threading.Thread(target=lambda: asyncio.run(grab()))
    t.start()
    t.join()
    assert len(mine) == 2 and mine[0] is not mine[1]
