"""A recording executor for in-process tests of the orchestration (libcni's fake exec).

It stands where `ProcessExecutor` stands: `find` and `execute`. Every call is
recorded; replies are scripted per (plugin type, verb); a gate holds a verb
until the test opens it, so orderings can be forced without sleeping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cni_agent.cni.errors import PluginError, PluginNotFound
from cni_agent.cni.exec import Invocation
from cni_agent.node.netns import NetnsId, netns_identity

ALL_VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]


@dataclass
class Call:
    plugin: str
    verb: str
    inv: Invocation
    stdin: dict[str, Any]
    done: bool = False
    # The namespace CNI_NETNS named when the plugin ran (the agent passes a
    # handle, /proc/<pid>/fd/N, which is closed afterwards); None: no netns.
    target: NetnsId | None = None

    @property
    def container(self) -> str:
        return self.inv.container_id


@dataclass
class Reply:
    """What a verb answers: an error (code, msg), or for ADD a result."""

    code: int = 0
    msg: str = ""
    output: bytes | None = None  # printed instead of the usual answer (exit 0)


@dataclass
class FakeExecutor:
    plugins: set[str] = field(default_factory=lambda: {"fake"})
    calls: list[Call] = field(default_factory=list)
    replies: dict[tuple[str, str], Reply] = field(default_factory=dict)
    gates: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    _addresses: dict[tuple[str, str], int] = field(default_factory=dict)
    _called: asyncio.Condition = field(default_factory=asyncio.Condition)

    def find(self, plugin: str, dirs: Sequence[str], verb: str) -> str:
        if plugin not in self.plugins:
            raise PluginNotFound(plugin, verb, f"no binary {plugin!r} (fake)")
        return f"/fake/{plugin}"

    def fail(self, plugin: str, verb: str, code: int = 999, msg: str = "scripted failure") -> None:
        self.replies[(plugin, verb)] = Reply(code, msg)

    def prints(self, plugin: str, verb: str, output: bytes) -> None:
        """`verb` of `plugin` succeeds printing exactly `output`."""
        self.replies[(plugin, verb)] = Reply(output=output)

    def succeed(self, plugin: str, verb: str) -> None:
        self.replies.pop((plugin, verb), None)

    def hold(self, plugin: str, verb: str) -> asyncio.Event:
        """Until the returned event is set, `verb` of `plugin` waits once started."""
        gate = self.gates[(plugin, verb)] = asyncio.Event()
        return gate

    def verbs(self, *skip: str) -> list[tuple[str, str]]:
        """(verb, container) of every call so far, without the `skip` verbs."""
        return [(c.verb, c.container) for c in self.calls if c.verb not in skip]

    def of(self, verb: str) -> list[Call]:
        return [c for c in self.calls if c.verb == verb]

    async def started(self, verb: str, count: int = 1) -> None:
        """Returns once `count` calls of `verb` have started."""
        async with self._called:
            await self._called.wait_for(lambda: len(self.of(verb)) >= count)

    async def execute(self, plugin: str, binary: str, inv: Invocation, stdin: bytes,
                      timeout: float) -> bytes:
        call = Call(plugin, inv.command, inv, json.loads(stdin) if stdin else {},
                    target=netns_identity(inv.netns) if inv.netns else None)
        self.calls.append(call)
        async with self._called:
            self._called.notify_all()
        try:
            gate = self.gates.get((plugin, inv.command))
            if gate is not None:
                async with asyncio.timeout(timeout):
                    await gate.wait()
            reply = self.replies.get((plugin, inv.command))
            if reply is not None and reply.code:
                raise PluginError(plugin, inv.command, reply.code, reply.msg)
            if reply is not None and reply.output is not None:
                return reply.output
            return self._output(call)
        finally:
            call.done = True

    def _output(self, call: Call) -> bytes:
        if call.verb == "VERSION":
            return json.dumps({"cniVersion": "1.1.0", "supportedVersions": ALL_VERSIONS}).encode()
        if call.verb != "ADD":
            return b""
        prev = call.stdin.get("prevResult")
        if prev is not None:
            return json.dumps(prev).encode()
        key = (call.container, call.inv.ifname)
        host = self._addresses.setdefault(key, len(self._addresses) + 2)
        return json.dumps({
            "cniVersion": call.stdin.get("cniVersion", "1.0.0"),
            "interfaces": [{"name": call.inv.ifname, "sandbox": call.inv.netns}],
            "ips": [{"address": f"10.99.{host // 250}.{host % 250}/16", "interface": 0}],
        }).encode()
