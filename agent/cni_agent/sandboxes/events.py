"""Sandbox events: each committed change of a sandbox, told to whoever listens.

One seam between the lifecycle (manager, attach, gc, checks) and whoever
publishes it (the D-Bus service's watchers, `SandboxChanged`): this module
knows nothing of D-Bus, and the lifecycle knows nothing of watchers.

A change is told once per call, after its outcome is in the journal (the
record written: the same moment the call's reply is decided), never for
what is then rolled back: a Setup whose ADD fails tells nothing. Told while
the sandbox's lock is held, so a sandbox's changes come in their order.

Nothing is built when nobody listens: every emitter tests `Events.on` (a
plain attribute) first, so the call path costs one attribute read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cni_agent.sandboxes.records import Attachment

log = logging.getLogger(__name__)


class Change(StrEnum):
    """What happened to the sandbox (`SandboxChanged`'s *change*)."""

    SET_UP = "set-up"  # a Setup added all its attachments
    ATTACHED = "attached"  # an Attach (or a runtime's ADD) added one
    DETACHED = "detached"  # a Detach (or a runtime's DEL) removed one; others may be left
    TORN_DOWN = "torn-down"  # a Teardown removed every attachment
    REAPED = "reaped"  # reaping removed them: its namespace died, a GC did not list it
    LOST = "lost"  # a repair's re-ADD failed: gone from the namespace, kept, retried
    REPAIRED = "repaired"  # a repair or a lost attachment's retry ADDed it again


class State(StrEnum):
    """An attachment's state after the change."""

    READY = "ready"
    GONE = "gone"  # removed: its address is released
    LOST = "lost"


@dataclass(frozen=True)
class AttachmentEvent:
    network: str
    ifname: str
    state: State
    mac: str  # "" when the result names none
    addresses: tuple[str, ...]  # CIDR form, as the CNI result gives them


@dataclass(frozen=True)
class SandboxEvent:
    sandbox_id: str  # the agent's id (a member's in its own id space: `Policy.shown`)
    change: Change
    owner: int  # the uid that set it up
    attachments: tuple[AttachmentEvent, ...]  # those this change touched


Listener = Callable[[SandboxEvent], None]


def addresses(result: Mapping[str, Any] | None, ifname: str) -> tuple[str, ...]:
    """The addresses of the sandbox's interface `ifname` in a CNI result (any
    version): the `ips` pointing at it, or at no interface; 0.2.0's ip4/ip6."""
    if not result:
        return ()
    ifaces = result.get("interfaces") or ()
    mine = {i for i, iface in enumerate(ifaces) if isinstance(iface, Mapping)
            and iface.get("name") == ifname and iface.get("sandbox")}
    out: list[str] = []
    for ip in result.get("ips") or ():
        if not isinstance(ip, Mapping) or not ip.get("address"):
            continue
        index = ip.get("interface")
        if index is None or not mine or index in mine:
            out.append(str(ip["address"]))
    for key in ("ip4", "ip6"):
        legacy = result.get(key)
        if isinstance(legacy, Mapping) and legacy.get("ip"):
            out.append(str(legacy["ip"]))
    return tuple(out)


def mac(result: Mapping[str, Any] | None, ifname: str) -> str:
    for iface in (result or {}).get("interfaces") or ():
        if isinstance(iface, Mapping) and iface.get("name") == ifname and iface.get("sandbox"):
            return str(iface.get("mac") or "").lower()
    return ""


def attachment_event(att: Attachment, state: State,
                     result: Mapping[str, Any] | None = None) -> AttachmentEvent:
    """`att` as an event tells it; `result` when the record's is not (yet) it."""
    res = result if result is not None else att.result
    if res is None and att.lost is not None:  # lost: what it had
        return AttachmentEvent(att.network, att.ifname, state, att.lost.mac, tuple(att.lost.ips))
    return AttachmentEvent(att.network, att.ifname, state, mac(res, att.ifname),
                           addresses(res, att.ifname))


class Events:
    """The seam: the service plugs its listener in (`listen`), the lifecycle
    calls `emit` — only after testing `on`, so nothing is built without one."""

    def __init__(self) -> None:
        self.on = False
        self._listener: Listener | None = None

    def listen(self, listener: Listener | None) -> None:
        self._listener = listener
        self.on = listener is not None

    def pause(self, paused: bool) -> None:
        """The listener keeps its place, but nobody is listening now (no watcher)."""
        self.on = self._listener is not None and not paused

    def emit(self, change: Change, sandbox_id: str, owner: int,
             attachments: Iterable[tuple[Attachment, State]],
             results: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Tell `change` (call only when `on`): `attachments` with the state each
        is in now; `results` by ifname where the record does not hold it yet."""
        listener = self._listener
        if listener is None:
            return
        results = results or {}
        event = SandboxEvent(sandbox_id, change, owner, tuple(
            attachment_event(a, state, results.get(a.ifname)) for a, state in attachments))
        if not event.attachments:
            return
        try:
            listener(event)
        except Exception:  # a listener's defect must not fail the call that changed it
            log.exception("sandbox event %s of %s not told", change, sandbox_id)
