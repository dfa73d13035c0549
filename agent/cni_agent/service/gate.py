"""Every message the agent's bus connection receives passes here first.

dbus-fast reads descriptors a message carries (SCM_RIGHTS) into the agent,
without close-on-exec, whatever the message is: a signal, an Introspect, a
call to another object. So, for every message, before anything else runs:
each descriptor is made close-on-exec (no plugin can inherit one) and closed,
unless the message is a call of a method that takes one (Setup and Attach's
`netns_fd`), whose serving closes them when it is answered. A call to a
method that takes none, carrying descriptors, is refused: here for the
standard interfaces (none of their methods takes one), in `_serve` for ours
(root's calls are let through; their descriptors are closed all the same).

Strangers (neither root nor members) whose uid is known are held to their
rate here, before dbus-fast serves even a property read (`limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from dbus_fast import Message, MessageFlag, MessageType

from cni_agent.api import ERROR_PREFIX, INTERFACE, OBJECT_PATH
from cni_agent.sandboxes.policy import Role
from cni_agent.service.auth import Authorizer
from cni_agent.service.limits import MAX_TARPIT, TARPIT, StrangerLimits

# Our methods that take a descriptor (option netns_fd, D-Bus type h).
TAKES_DESCRIPTORS = frozenset({"Setup", "Attach"})
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"


@dataclass(frozen=True)
class CallInfo:
    """What the method serving a call needs to know of its message."""

    sender: str | None = None
    fds: tuple[int, ...] = ()  # kept for the method; closed once it is answered
    carried: int = 0  # descriptors the message carried
    interactive: bool = False  # ALLOW_INTERACTIVE_AUTHORIZATION
    counted: bool = False  # a stranger's call already counted against its rate here


def _descriptors(msg: Message) -> list[int]:
    return [fd for fd in (msg.unix_fds or ()) if isinstance(fd, int)]


def close_all(fds: tuple[int, ...] | list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _cloexec(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)


class Gate:
    def __init__(self, authorizer: Authorizer, limits: StrangerLimits,
                 signatures: Mapping[str, str]) -> None:
        self.authorizer = authorizer
        self.limits = limits
        self._signatures = signatures
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
        keep = (is_call and self._ours(msg) and msg.member in TAKES_DESCRIPTORS
                and (msg.signature or "") == self._signatures.get(msg.member or ""))
        if fds:
            _cloexec(fds)
            if not keep:
                close_all(fds)
        if not is_call:
            return None
        wants_reply = not msg.flags & MessageFlag.NO_REPLY_EXPECTED
        if fds and not self._ours(msg):
            if not wants_reply:
                return True
            return Message.new_error(msg, INVALID_ARGS, f"{msg.interface}.{msg.member} takes no "
                                                        "file descriptors")
        counted = False
        known = self.authorizer.known(msg.sender)
        if known is None and msg.sender and not self._ours(msg):
            self.authorizer.learn(msg.sender)  # ours: `_serve` identifies the caller
        elif known is not None and known.role is Role.STRANGER:
            if not self.limits.take(known.uid):
                if keep:
                    close_all(fds)
                return self._tarpit(msg, wants_reply)
            counted = True
        self.call.set(CallInfo(msg.sender, tuple(fds) if keep else (), len(fds),
                               bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION),
                               counted))
        if self._ours(msg) and msg.member and msg.member in self._signatures:
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
        if self.limits.tarpitted >= MAX_TARPIT:
            return reply
        self.limits.tarpitted += 1

        def send() -> None:
            self.limits.tarpitted -= 1
            with contextlib.suppress(Exception):  # the connection may be gone by now
                self.send(reply)

        asyncio.get_running_loop().call_later(TARPIT, send)
        return True
