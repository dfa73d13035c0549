"""Teardowns that did not wait for the agent: the DELs cni-agent-shim queued
while no agent ran (`node.delqueue` has the files), run at start-up.

Once recovery is over they are drained in the order they were queued, in the
background (READY=1 and other sandboxes' calls do not wait for them); a call
for a sandbox whose DEL is still queued runs that DEL first
(`SandboxManager.queued_ids`). Each is run as the runtime's own DEL would
have been, through the same path as a CNICall (`ShimCalls.handle`), and only
if it is root's: a CNICall that changes something is root's alone.

Exactly once. Before it runs, a file is bound durably to the generation of
its sandbox's record (`SandboxRecord.generation`, in the journal): the
generation the runtime's DEL was for, since no shim queues while an agent
runs. A DEL bound to a generation that is no longer the sandbox's is not run:
`gone` when nothing of the sandbox is recorded any more (a run killed after
the DEL was committed, or a reaping pass, did it), `stale` when the id was set
up again since (a file a power loss brought back). The file goes only once
the DEL's outcome is committed to the journal; a DEL a kill interrupted is
finished by recovery (DEL is idempotent) and its file then found `gone`. A
DEL that fails keeps its file, for the next start, and does not hold the
sandbox's other calls up.

Each outcome is logged (SANDBOX_ID, IFNAME) and counted in
`cni_agent_queued_teardowns_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from contextvars import ContextVar

from cni_agent.cni.errors import (
    CODE_DECODE_FAILURE,
    CODE_INCOMPATIBLE_VERSION,
    CODE_INVALID_ENV,
    CacheError,
)
from cni_agent.cni.logctx import log_fields
from cni_agent.node import delqueue
from cni_agent.node.delqueue import Queued
from cni_agent.sandboxes.manager import SandboxManager
from cni_agent.sandboxes.store import SandboxStore
from cni_agent.service.cnicall import ShimCalls

log = logging.getLogger(__name__)

# CNI codes that refuse the request itself (incompatible version, bad
# variables, undecodable config): running it again changes nothing.
REFUSED_CODES = frozenset({CODE_INCOMPATIBLE_VERSION, CODE_INVALID_ENV, CODE_DECODE_FAILURE})

# The sandbox whose queued DELs the current task runs: its own calls go through.
_running: ContextVar[str | None] = ContextVar("cni_agent_queued_running", default=None)


class QueuedTeardowns:
    def __init__(self, shim: ShimCalls, store: SandboxStore, manager: SandboxManager,
                 on_outcome: Callable[[str], None] = lambda outcome: None) -> None:
        self.shim = shim
        self.store = store
        self.manager = manager
        self._on_outcome = on_outcome
        self._pending: dict[str, list[Queued]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._drain: asyncio.Task[None] | None = None
        self._stopping = False
        self.outcomes: list[tuple[str, str, str]] = []  # (sandbox, ifname, outcome): tests, logs

    def load(self, items: list[Queued]) -> None:
        """What the start-up scan found (the agent holding the queue's lock)."""
        for sandbox_id, queued in delqueue.by_sandbox(items):
            self._pending[sandbox_id] = queued
        self.manager.queued_ids = self._pending
        self.manager.run_queued = self.run_first
        if items:
            log.info("%d DEL(s) of %d sandbox(es) were queued by cni-agent-shim while no agent "
                     "ran; they run once recovery is over", len(items), len(self._pending))

    async def bind(self) -> None:
        """The journal is replayed, recovery not begun: each DEL is bound to
        the generation its sandbox had when the agent before stopped, the one
        the runtime's DEL was for (what recovery and reaping then do to it
        makes the DEL `gone`, never run twice)."""
        unbound = [q for items in self._pending.values() for q in items
                   if q.generation is None and not q.error and q.uid == 0]
        if not unbound:
            return
        try:
            # A record from before generations gets one now, durably, before a
            # file names it: a later write of it must not look like another set-up.
            todo = [(q, self.store.stamp(q.sandbox_id)) for q in unbound]
            await self.store.commit()
            bound = await asyncio.to_thread(delqueue.bind_all, todo)
        except (OSError, CacheError) as e:
            log.warning("the queued DELs could not be bound to their generations now (each is "
                        "bound before it runs): %s", e)
            return
        by_path = {old.path: new for (old, _), new in zip(todo, bound, strict=True)}
        for sandbox_id, items in self._pending.items():
            self._pending[sandbox_id] = [by_path.get(q.path, q) for q in items]

    def start(self) -> None:
        """Recovery is over: drain the queue in the background."""
        if self._pending and self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(
                self._drain_all(), name="cni-agent-queued-teardowns")

    async def stop(self, timeout: float = 10.0) -> None:
        """At shutdown: no new sandbox's DELs; the one running finishes (within
        `timeout`, else it is cancelled: recovery finishes it at the next start)."""
        self._stopping = True
        running = [t for t in [self._drain, *self._tasks.values()] if t is not None]
        if running:
            _done, late = await asyncio.wait(running, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def run_first(self, sandbox_id: str) -> None:
        """A call for `sandbox_id` arrived: its queued DELs run first (the call
        waits for them, whatever their outcome)."""
        if _running.get() == sandbox_id or sandbox_id not in self._pending:
            return
        with contextlib.suppress(Exception):  # logged by the task
            await asyncio.shield(self._start(sandbox_id))

    def _start(self, sandbox_id: str) -> asyncio.Task[None]:
        task = self._tasks.get(sandbox_id)
        if task is None:
            task = self._tasks[sandbox_id] = asyncio.get_running_loop().create_task(
                self._run_sandbox(sandbox_id), name=f"cni-agent-queued-{sandbox_id}")
        return task

    async def _drain_all(self) -> None:
        for sandbox_id in list(self._pending):
            if self._stopping:
                return
            with contextlib.suppress(Exception):
                await self._start(sandbox_id)

    async def _run_sandbox(self, sandbox_id: str) -> None:
        _running.set(sandbox_id)
        try:
            await self.manager.recovered(asyncio.get_running_loop().time() + 3600)
            for q in self._pending.get(sandbox_id, []):
                with log_fields(SANDBOX_ID=q.sandbox_id or sandbox_id, IFNAME=q.ifname):
                    try:
                        outcome = await self._one(q)
                    except Exception as e:
                        log.error("a DEL queued by cni-agent-shim (%s) could not be run, it is "
                                  "kept for the next start: %s", q.path, e)
                        outcome = "failed"
                self.outcomes.append((sandbox_id, q.ifname, outcome))
                self._on_outcome(outcome)
        finally:
            self._pending.pop(sandbox_id, None)
            self._tasks.pop(sandbox_id, None)

    async def _one(self, q: Queued) -> str:
        if q.error or q.uid != 0:
            why = q.error or f"it is uid {q.uid}'s, and only root's DELs are run"
            try:
                where = await asyncio.to_thread(delqueue.set_aside, q)
            except OSError as e:
                where = f"{q.path} (could not be renamed: {e.strerror})"
            log.error("a DEL queued by cni-agent-shim is not run: %s; kept as %s", why, where)
            return "refused"
        sandbox_id = q.sandbox_id
        if q.generation is None:  # not bound at start-up (the disk refused then)
            generation = self.store.stamp(sandbox_id)
            await self.store.commit()
            q = await asyncio.to_thread(delqueue.bind, q, generation)
        current = self.store.generation(sandbox_id)
        if q.generation != current:
            await asyncio.to_thread(delqueue.remove, q)
            if self.store.read(sandbox_id) is not None:
                log.info("a DEL of %s/%s queued while the agent was down is dropped: the "
                         "sandbox was set up again since (generation %d, the DEL's %d)",
                         sandbox_id, q.ifname, current, q.generation)
                return "stale"
            log.info("a DEL of %s/%s queued while the agent was down was already done "
                     "(nothing of its generation %d is left)", sandbox_id, q.ifname, q.generation)
            return "gone"
        env = dict(q.env)
        if env.get("CNI_NETNS") and not await asyncio.to_thread(_same_netns, env["CNI_NETNS"],
                                                                q.netns):
            env["CNI_NETNS"] = ""  # gone, or another namespace now: DEL without one
        answer = await self.shim.handle(env, q.config)
        if answer.code in REFUSED_CODES:  # the request itself: it never will succeed
            where = await asyncio.to_thread(delqueue.set_aside, q)
            log.error("a DEL of %s/%s queued while the agent was down is refused, kept as %s: "
                      "%s", sandbox_id, q.ifname, where, _message(answer.output))
            return "refused"
        if answer.exit_status != 0:
            log.error("a DEL of %s/%s queued while the agent was down failed; its file is kept "
                      "and run again at the next start: %s", sandbox_id, q.ifname,
                      _message(answer.output))
            return "failed"
        try:
            await self.store.commit()  # the DEL's outcome durable before its request goes
        except CacheError as e:
            log.error("a DEL of %s/%s queued while the agent was down ran, but its outcome is "
                      "not durable, so its file is kept: %s", sandbox_id, q.ifname, e)
            return "failed"
        await asyncio.to_thread(delqueue.remove, q)
        log.info("a DEL of %s/%s queued by cni-agent-shim %.0fs ago while the agent was down "
                 "is done", sandbox_id, q.ifname, max(0.0, time.time() - q.queued))
        return "done"


def _same_netns(path: str, identity: tuple[int, int] | None) -> bool:
    """Whether `path` still names the namespace file the shim saw."""
    if identity is None:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == identity


def _message(output: str) -> str:
    try:
        doc = json.loads(output)
    except ValueError:
        return output[:200]
    if isinstance(doc, dict):
        return f"{doc.get('msg', '')} (code {doc.get('code')}) {doc.get('details', '')}".strip()
    return output[:200]
