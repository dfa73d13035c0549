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

Then every call of a caller that is not root is held to its rates here
(`limits`: a stranger's uid's, all strangers' together, all members'
together), before dbus-fast serves even a property read or an Introspect.
So nothing is served before the caller's uid is known: the first message of
a connection starts the lookup (GetConnectionCredentials, once per sender)
and it and the ones after it wait, in a queue of that connection's (HELD
messages; HELD_ALL for all connections together, each one's first message
aside), until the answer comes; they are then taken in order as if they had
just arrived. A message past either bound is answered Busy at once (its
descriptors closed; nothing answered when no reply is expected), so a
caller that pipelines a flood on a new connection is refused what the queue
cannot hold instead of being served unlimited. If the lookup fails (the
caller left), the waiting calls are answered AccessDenied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from dbus_fast import Message, MessageFlag, MessageType, Variant

from cni_agent.api import ERROR_PREFIX, INTERFACE, OBJECT_PATH, AgentError
from cni_agent.sandboxes.policy import Caller, Role
from cni_agent.service.auth import Authorizer
from cni_agent.service.limits import Limits

log = logging.getLogger(__name__)

# Our methods that take a descriptor (option netns_fd, D-Bus type h): a
# member passes its namespace again for Teardown, Detach and Check (revision 5).
TAKES_DESCRIPTORS = frozenset({"Setup", "Attach", "Teardown", "Detach", "Check"})
INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"
# A connection's calls waiting for its uid to be known: the system bus's own
# bound of calls pending a reply per connection (max_replies_per_connection),
# so that a caller the bus lets through is never refused for it.
HELD = 128
HELD_ALL = 4096  # all connections' together (each connection's first call aside)


@dataclass(frozen=True)
class CallInfo:
    """What the method serving a call needs to know of its message."""

    sender: str | None = None
    fds: tuple[int, ...] = ()  # kept for the method; closed once it is answered
    interactive: bool = False  # ALLOW_INTERACTIVE_AUTHORIZATION
    counted: bool = False  # a non-root call already counted against its rates here
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


@dataclass(frozen=True)
class _Replay:
    """A held call, taken again once its sender's uid is known."""

    msg: Message
    fds: tuple[int, ...]  # the descriptors kept for its method (the others are closed)
    caller: Caller


class Gate:
    def __init__(self, authorizer: Authorizer, limits: Limits,
                 signatures: Mapping[str, str], options: Mapping[str, str]) -> None:
        self.authorizer = authorizer
        self.limits = limits
        self._signatures = signatures
        self._options = options  # option key → its D-Bus type
        # Set by the daemon once the bus is connected: sends a reply later
        # (tarpit, held calls), and hands a held call to dbus-fast again.
        self.send: Callable[[Message], object] = lambda reply: None
        self.dispatch: Callable[[Message], object] = lambda msg: None
        # Each signal the connection receives (watchers.py: a watcher left the bus).
        self.on_signal: Callable[[Message], None] = lambda msg: None
        # Read by the method serving the call (a task copies the context at creation).
        self.call: ContextVar[CallInfo] = ContextVar(
            "cni_agent_call", default=CallInfo())  # noqa: B039 (frozen: immutable)
        # sender → its calls waiting for its uid, in arrival order
        self._held: dict[str, list[tuple[Message, tuple[int, ...]]]] = {}
        self._held_count = 0
        self._replay: _Replay | None = None

    def _ours(self, msg: Message) -> bool:
        return msg.path == OBJECT_PATH and msg.interface in (INTERFACE, None)

    def __call__(self, msg: Message) -> Message | bool | None:
        """The bus's message handler: None lets dbus-fast go on, True means
        handled (an answer is sent later, or none is expected), a Message is
        the answer. Never raises: dbus-fast would tell the caller why."""
        replay, self._replay = self._replay, None
        if replay is not None and replay.msg is msg:
            # Its descriptors were dealt with when it arrived: `fds` are kept ones.
            fds, keep, is_call = list(replay.fds), bool(replay.fds), True
        else:
            replay = None
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
            if msg.message_type is MessageType.SIGNAL:
                self.on_signal(msg)
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
        kept = tuple(fds) if keep else ()
        counted = False
        if msg.sender is not None:
            known = replay.caller if replay is not None else (
                None if msg.sender in self._held else self.authorizer.known(msg.sender))
            if known is None:  # nothing served before its uid is known
                return self._hold(msg, kept, bool(wants_reply))
            over = self.limits.take(known)
            if over is not None:
                close_all(kept)
                return self._tarpit(msg, bool(wants_reply), over)
            counted = known.role is not Role.ROOT
        self.call.set(CallInfo(msg.sender, kept,
                               bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION),
                               counted, bool(wants_reply),
                               ours and _weight(msg.body) > BIG))
        if ours and msg.member and msg.member in self._signatures:
            expected = self._signatures[msg.member]
            if (msg.signature or "") != expected:
                close_all(kept)
                return Message.new_error(
                    msg, ERROR_PREFIX + "InvalidArgument",
                    f"{msg.member} takes arguments ({expected}), not ({msg.signature or ''})",
                )
        return None

    def _hold(self, msg: Message, fds: tuple[int, ...], wants_reply: bool) -> Message | bool:
        """Keep a call of a sender whose uid is not known yet until it is (the
        lookup starts with its first); Busy past the queue's bounds."""
        sender = msg.sender
        assert sender is not None
        held = self._held.get(sender)
        # A connection's first call is always taken (the lookup starts with it;
        # the bus bounds the connections): root's one call on a new one is never
        # refused, however many strangers' calls wait.
        if held is not None and (len(held) >= HELD or self._held_count >= HELD_ALL):
            close_all(fds)
            if not wants_reply:
                return True
            bound = (f"{HELD} calls of this connection" if len(held) >= HELD
                     else f"{HELD_ALL} calls of all connections")
            return Message.new_error(
                msg, ERROR_PREFIX + "Busy",
                f"{bound} already wait until the agent knows who sent them (their uid is being "
                "looked up); send again once an answer came")
        if held is None:
            held = self._held[sender] = []
            self.authorizer.lookup(sender).add_done_callback(
                lambda task: self._release(sender, task))
        held.append((msg, fds))
        self._held_count += 1
        return True

    def _release(self, sender: str, task: asyncio.Task[tuple[int, frozenset[int]]]) -> None:
        """The lookup answered: the sender's held calls, in order, as if they
        had just arrived; AccessDenied for each if it failed."""
        held = self._held.pop(sender, [])
        self._held_count -= len(held)
        failed = task.cancelled() or task.exception() is not None
        for msg, fds in held:
            if failed:
                close_all(fds)
                if not msg.flags & MessageFlag.NO_REPLY_EXPECTED:
                    why = task.exception() if not task.cancelled() else None
                    text = why.message if isinstance(why, AgentError) else \
                        "cannot determine the caller's credentials"
                    self._send_later(Message.new_error(msg, ERROR_PREFIX + "AccessDenied", text))
                continue
            self._replay = _Replay(msg, fds, self.authorizer.caller(*task.result()))
            try:
                self.dispatch(msg)
            except Exception:  # dbus-fast answers what fails in there; this is a defect
                log.exception("a held call could not be served")
            finally:
                self._replay = None

    def _send_later(self, reply: Message) -> None:
        with contextlib.suppress(Exception):  # the connection may be gone by now
            self.send(reply)

    def _tarpit(self, msg: Message, wants_reply: bool, err: AgentError) -> Message | bool:
        """Busy for a call over a rate: after a while, so that a caller waiting
        for each answer slows to our pace (at once when too many wait)."""
        if not wants_reply:
            return True
        reply = Message.new_error(msg, ERROR_PREFIX + str(err.kind), err.message)
        return True if self.limits.tarpit(lambda: self._send_later(reply)) else reply
