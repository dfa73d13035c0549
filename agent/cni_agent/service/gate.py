"""Every message the agent's bus connection receives passes here first.

dbus-fast reads descriptors a message carries (SCM_RIGHTS) into the agent,
without close-on-exec, whatever the message is: a signal, an Introspect, a
call to another object. So, for every message, before anything else runs:
each descriptor is made close-on-exec (no plugin can inherit one) and closed,
unless the message is a call of a method that takes one (`netns_fd` of
Setup, Attach, Teardown, Detach and Check), whose serving closes them when it
is answered. Any other call
carrying descriptors is refused here, whoever sends it: no other method
takes one, and dbus-fast would walk its body for them (and can fail in
there, out of our sight). So are calls of those whose options are not the
documented ones, for the same reason.

Strangers (neither root nor members) whose uid is known are held to their
rate here, before dbus-fast serves even a property read (`limits`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from dbus_fast import Message, MessageFlag, MessageType, Variant

from cni_agent.api import ERROR_PREFIX, INTERFACE, OBJECT_PATH
from cni_agent.sandboxes.policy import Role
from cni_agent.service.auth import Authorizer
from cni_agent.service.limits import StrangerLimits

# Our methods that take a descriptor (option netns_fd, D-Bus type h): a
# member passes its namespace again for Teardown, Detach and Check (revision 5).
TAKES_DESCRIPTORS = frozenset({"Setup", "Attach", "Teardown", "Detach", "Check"})
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"


@dataclass(frozen=True)
class CallInfo:
    """What the method serving a call needs to know of its message."""

    sender: str | None = None
    fds: tuple[int, ...] = ()  # kept for the method; closed once it is answered
    interactive: bool = False  # ALLOW_INTERACTIVE_AUTHORIZATION
    counted: bool = False  # a stranger's call already counted against its rate here
    wants_reply: bool = True  # not NO_REPLY_EXPECTED
    big: bool = False  # its arguments weigh more than BIG bytes


def _descriptors(msg: Message) -> list[int]:
    return [fd for fd in (msg.unix_fds or ()) if isinstance(fd, int)]


def close_all(fds: tuple[int, ...] | list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def close_on_exec(fds: Iterable[int]) -> None:
    """No plugin inherits these (the daemon's inherited ones, a message's)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)


BIG = 1 << 20


def _weight(body: list[object], limit: int = BIG, nodes: int = 256) -> int:
    """About how many bytes of text a message's arguments hold, counted up to
    `limit` (or `nodes` values looked at): enough to tell a huge call."""
    total, todo = 0, list(body)
    while todo and nodes > 0 and total <= limit:
        nodes -= 1
        item = todo.pop()
        if isinstance(item, str | bytes):
            total += len(item)
        elif isinstance(item, Variant):
            todo.append(item.value)
        elif isinstance(item, list | tuple):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
    return total


def _options_ok(msg: Message, options: Mapping[str, str]) -> bool:
    """Whether a call's options (its last argument) are all known
    keys with their documented types (netns_fd: h, the only descriptor)."""
    opts = msg.body[-1] if msg.body else None
    return isinstance(opts, dict) and all(
        isinstance(v, Variant) and options.get(k) == v.signature for k, v in opts.items())


class Gate:
    def __init__(self, authorizer: Authorizer, limits: StrangerLimits,
                 signatures: Mapping[str, str], options: Mapping[str, str]) -> None:
        self.authorizer = authorizer
        self.limits = limits
        self._signatures = signatures
        self._options = options  # option key → its D-Bus type
        # Set by the daemon once the bus is connected: sends a reply later (tarpit).
        self.send: Callable[[Message], object] = lambda reply: None
        # Read by the method serving the call (a task copies the context at creation).
        self.call: ContextVar[CallInfo] = ContextVar(
            "cni_agent_call", default=CallInfo())  # noqa: B039 (frozen: immutable)

    def _ours(self, msg: Message) -> bool:
        return msg.path == OBJECT_PATH and msg.interface in (INTERFACE, None)

    def __call__(self, msg: Message) -> Message | bool | None:
        """The bus's message handler: None lets dbus-fast go on, True means
        handled (an answer is sent later, or none is expected), a Message is
        the answer. Never raises: dbus-fast would tell the caller why."""
        fds = _descriptors(msg)
        is_call = msg.message_type is MessageType.METHOD_CALL
        # Kept only for a call dbus-fast will surely hand to that method (its
        # interface named: without one, its dispatch is not ours to count on).
        keep = bool(fds) and is_call and (
            msg.path == OBJECT_PATH and msg.interface == INTERFACE
            and msg.member in TAKES_DESCRIPTORS
            and (msg.signature or "") == self._signatures.get(msg.member or "")
            and _options_ok(msg, self._options))
        if fds:
            close_on_exec(fds)
            if not keep:
                close_all(fds)
        if not is_call:
            return None
        wants_reply = not msg.flags & MessageFlag.NO_REPLY_EXPECTED
        ours = self._ours(msg)
        if not wants_reply and not ours:
            # A property read or an Introspect nobody waits for does nothing
            # (and dbus-fast's handlers of those raise out of sight of any caller).
            return True
        if fds and not keep:
            if not wants_reply:
                return True
            if ours:
                return Message.new_error(
                    msg, ERROR_PREFIX + "InvalidArgument",
                    f"{msg.member} takes no file descriptors" if msg.member not in
                    TAKES_DESCRIPTORS else f"{msg.member}: descriptors come only as option "
                    "netns_fd, with options of their documented types")
            return Message.new_error(msg, INVALID_ARGS, f"{msg.interface}.{msg.member} takes no "
                                                        "file descriptors")
        counted = False
        known = self.authorizer.known(msg.sender)
        if known is None and msg.sender and not ours:
            self.authorizer.learn(msg.sender)  # ours: `_serve` identifies the caller
        elif known is not None and known.role is Role.STRANGER:
            if not self.limits.take(known.uid):
                if keep:
                    close_all(fds)
                return self._tarpit(msg, wants_reply)
            counted = True
        self.call.set(CallInfo(msg.sender, tuple(fds) if keep else (),
                               bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION),
                               counted, bool(wants_reply),
                               ours and _weight(msg.body) > BIG))
        if ours and msg.member and msg.member in self._signatures:
            expected = self._signatures[msg.member]
            if (msg.signature or "") != expected:
                return Message.new_error(
                    msg, ERROR_PREFIX + "InvalidArgument",
                    f"{msg.member} takes arguments ({expected}), not ({msg.signature or ''})",
                )
        return None

    def _tarpit(self, msg: Message, wants_reply: bool) -> Message | bool:
        """Busy for a call over its uid's rate: after a while, so that a caller
        waiting for each answer slows to our pace (at once when too many wait)."""
        if not wants_reply:
            return True
        err = self.limits.over_rate()
        reply = Message.new_error(msg, ERROR_PREFIX + str(err.kind), err.message)

        def send() -> None:
            with contextlib.suppress(Exception):  # the connection may be gone by now
                self.send(reply)

        return True if self.limits.tarpit(send) else reply
