"""Per-network STATUS polls: each network's STATUS in its own task.

A slow or hanging plugin holds back only its own network's answer: the
monitor decides its verdict from the last answer of each network, whenever
any of them arrives and whenever the config dir is re-read. Each poll is
bounded by the runtime's STATUS timeout (per plugin of the list).

Requests are counted in rounds (the monitor's request counter): a poll that
is asked for a newer round while one is in flight runs once more after it,
so a reload sees a STATUS that started after it was asked, and a stream of
file events never cancels, and so never starves, a slow STATUS.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.errors import CNIError
from cni_agent.cni.runtime import CNIRuntime

log = logging.getLogger(__name__)


@dataclass
class Poll:
    """One network's config and what its STATUS last answered for it."""

    net: NetworkConfigList
    generation: int  # a new one for every new or changed config
    checked: bool = False  # a STATUS of this generation has answered
    failure: str | None = None  # its error; None when it succeeded
    wanted: int = 0  # the newest round this network was asked to answer
    answered: int = 0  # the round its last finished STATUS served
    task: asyncio.Task[None] | None = None


class Polls:
    def __init__(self, runtime: CNIRuntime, on_answer: Callable[[], None]) -> None:
        self._runtime = runtime
        self._on_answer = on_answer  # called after each applied answer
        self._polls: dict[str, Poll] = {}
        self._generations = itertools.count(1)

    def get(self, name: str) -> Poll | None:
        return self._polls.get(name)

    def reconcile(self, nets: Iterable[NetworkConfigList]) -> None:
        """Track exactly `nets`: a new or changed config starts unchecked."""
        wanted = {n.name: n for n in nets}
        for name in [n for n in self._polls if n not in wanted]:
            self._drop(self._polls.pop(name))
        for name, net in wanted.items():
            old = self._polls.get(name)
            if old is not None and old.net == net:
                continue  # unchanged: its last answer still holds
            if old is not None:
                self._drop(old)
            # A changed config is a new network for STATUS: the old answer is not about it.
            self._polls[name] = Poll(net, next(self._generations))

    def request(self, round_: int) -> None:
        """Poll every idle network now; one in flight answers `round_` after it."""
        for poll in self._polls.values():
            poll.wanted = max(poll.wanted, round_)
            if poll.task is None:
                poll.task = asyncio.create_task(self._run(poll), name=f"cni-agent-status-{poll.net.name}")

    def answered(self, round_: int) -> bool:
        """Whether every network has answered a STATUS of `round_` or later."""
        return all(p.answered >= round_ for p in self._polls.values())

    async def stop(self) -> None:
        """Cancel every poll in flight (killing its plugin) and wait for them."""
        tasks = [p.task for p in self._polls.values() if p.task is not None]
        self._polls.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def _drop(self, poll: Poll) -> None:
        if poll.task is not None:
            poll.task.cancel()  # the executor kills the plugin; nothing waits for it
            poll.task = None

    async def _run(self, poll: Poll) -> None:
        generation = poll.generation
        try:
            while True:
                serving = poll.wanted
                failure = await self._status(poll.net)
                # The generation check: an answer about a config that has since
                # changed or gone must not count for the new one.
                if self._polls.get(poll.net.name) is not poll or poll.generation != generation:
                    return
                poll.checked, poll.failure = True, failure
                poll.answered = max(poll.answered, serving)
                self._on_answer()
                if poll.wanted <= serving:
                    return
        finally:
            if poll.task is asyncio.current_task():
                poll.task = None

    async def _status(self, net: NetworkConfigList) -> str | None:
        try:
            await self._runtime.status(net)
        except CNIError as e:
            return str(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # monitoring must never stop
            log.exception("STATUS of %s failed unexpectedly", net.name)
            return f"internal error while checking the network: {e}"
        return None
