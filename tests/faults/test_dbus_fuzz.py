"""A fuzz of the whole D-Bus surface, as a caller that is not root (issue 35).

Hypothesis, in this (root) process, makes the messages: our methods, the
standard interfaces' and made-up ones, on our object and others, with the
right signature and random arguments or a random signature, strings of odd
unicode and sizes up to the bus's limit, nested variants, arrays, descriptors
attached, and the header flags a caller may set. `nobody` sends them through
tests/support/stranger.py, one at a time, to an agent on a permissive bus (so
that everything reaches the agent). Reproducible: derandomized, no example
database, a fixed number of examples (some 30 s in `make test`).

Every call that expects a reply gets one, and in time. Afterwards the agent is
alive, holds the descriptors it held before, has not grown by more than
RSS_GROWTH, has logged no traceback, and serves root's Setup and Teardown.
"""

from __future__ import annotations

import collections
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from tests.support.agent import Agent, Bus
from tests.support.stranger import (
    ALLOW_INTERACTIVE_AUTHORIZATION,
    INTROSPECTABLE,
    MAX_MESSAGE_FDS,
    NO_REPLY_EXPECTED,
    PEER,
    PROPERTIES,
    Stranger,
    fd_targets,
    idle_fds,
    rss_kib,
    settle_fds,
)

pytestmark = pytest.mark.root

IFACE = "org.cniagent.Agent1"
PATH = "/org/cniagent/Agent1"
NO_AUTO_START = 0x2
EXAMPLES = 350
RSS_GROWTH = 20 * 1024  # KiB
# Drawn now and then; the explicit examples go up to dbus-daemon's
# max_message_size (32 MiB). Each costs the bus and the agent about a second.
HUGE = [1 << 16, 1 << 20, 4 << 20]
MAX_SIZE = 31 << 20

# The contract's methods and their signatures, and the standard interfaces'.
OURS = {
    "Setup": "ssa{sv}", "Teardown": "ssa{sv}", "Check": "ssa{sv}", "Show": "s",
    "ListSandboxes": "", "WaitReady": "d", "GarbageCollect": "as", "Reload": "",
    "SetPodCIDRs": "as", "ResetPodCIDRs": "", "Attach": "ssssa{sv}", "Detach": "ssssa{sv}",
    "CNICall": "a{ss}s", "CheckSandboxes": "as",
}
STANDARD = {
    INTROSPECTABLE: {"Introspect": ""},
    PEER: {"Ping": "", "GetMachineId": ""},
    PROPERTIES: {"Get": "ss", "GetAll": "s", "Set": "ssv"},
}
WORDS = [
    IFACE, PROPERTIES, "NetworkReady", "Status", "PodCIDRs", "Version", "networks", "args", "pod",
    "capabilities", "netns_fd", "CNI_COMMAND", "STATUS", "VERSION", "ADD", "DEL", "GC", "CHECK",
    "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "testnet", "eth0", "/run/netns/x",
    "/proc/self/ns/net", "/proc/1/ns/net", "/dev/null", "10.0.0.0/24", "", "..", "../../etc/passwd",
    '{"cniVersion": "1.1.0", "name": "testnet"}', '{"portMappings": [{"hostPort": 23}]}',
    "ｓbx", "sbx\u200b", "\u202eevil", "\U0001f600" * 50, "a\nb", "\x7f\x01\x1b[2J",
]

BASIC = "ybnqiuxtdsog"
INTS = {"y": (0, 255), "n": (-(1 << 15), (1 << 15) - 1), "q": (0, (1 << 16) - 1),
        "i": (-(1 << 31), (1 << 31) - 1), "u": (0, (1 << 32) - 1),
        "x": (-(1 << 63), (1 << 63) - 1), "t": (0, (1 << 64) - 1)}

def rarely(this: st.SearchStrategy[Any], otherwise: st.SearchStrategy[Any],
           p: float) -> st.SearchStrategy[Any]:
    """`this` with probability about p. (Hypothesis favours the ends of a range,
    so the choice is a float in the middle of [0, 1), not an integer equal to 0.)"""
    return st.floats(0, 1).flatmap(lambda x: this if 0.5 <= x < 0.5 + p else otherwise)


text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)
# {"rep": …} is expanded by the worker; "size" is for the bound on a message's size.
huge = st.tuples(st.sampled_from(["a", "é", "\U0001f600", "\u202e", "/"]), st.sampled_from(HUGE)).map(
    lambda cn: {"rep": [cn[0], cn[1] // len(cn[0].encode())], "size": cn[1]})
strings = st.one_of(st.sampled_from(WORDS), text, text, rarely(huge, text, 1 / 100))
object_paths = st.one_of(
    st.sampled_from(["/", "/org", "/org/cniagent", PATH, PATH + "/x", "/org/freedesktop/DBus"]),
    st.lists(st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True), min_size=1, max_size=6).map(
        lambda parts: "/" + "/".join(parts)))
member_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
interface_names = st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True),
                           min_size=2, max_size=5).map(".".join)

# A type: ("b", token) basic, ("a", child), ("e", key token, value type) dict,
# ("r", [children]) struct, ("v",) variant.
Type = tuple[Any, ...]


def sig(t: Type) -> str:
    if t[0] == "b":
        return str(t[1])
    if t[0] == "a":
        return "a" + sig(t[1])
    if t[0] == "e":
        return "a{" + t[1] + sig(t[2]) + "}"
    if t[0] == "r":
        return "(" + "".join(sig(c) for c in t[1]) + ")"
    return "v"


def parse(signature: str) -> list[Type]:
    """A signature's complete types."""
    out, rest = [], signature
    while rest:
        t, rest = _parse_one(rest)
        out.append(t)
    return out


def _parse_one(s: str) -> tuple[Type, str]:
    head, rest = s[0], s[1:]
    if head == "v":
        return ("v",), rest
    if head == "a" and rest.startswith("{"):  # a{KV}
        value, rest = _parse_one(rest[2:])
        return ("e", s[2], value), rest[1:]
    if head == "a":
        child, rest = _parse_one(rest)
        return ("a", child), rest
    if head == "(":
        children = []
        while not rest.startswith(")"):
            child, rest = _parse_one(rest)
            children.append(child)
        return ("r", tuple(children)), rest[1:]
    return ("b", head), rest


def types(with_fds: bool) -> st.SearchStrategy[Type]:
    alphabet = BASIC + ("h" if with_fds else "")
    basic = st.sampled_from(alphabet).map(lambda tok: ("b", tok))
    keys = st.sampled_from(alphabet)  # any basic type may be a key

    def extend(inner: st.SearchStrategy[Type]) -> st.SearchStrategy[Type]:
        return st.one_of(
            inner.map(lambda c: ("a", c)),
            st.tuples(keys, inner).map(lambda kv: ("e", kv[0], kv[1])),
            st.lists(inner, min_size=1, max_size=4).map(lambda cs: ("r", tuple(cs))),
            st.just(("v",)),
        )

    return st.recursive(basic, extend, max_leaves=5)


TYPES = {True: types(True), False: types(False)}


@functools.cache
def values(t: Type, nfds: int, depth: int = 0) -> st.SearchStrategy[Any]:
    """JSON for stranger_worker.py's `value` (see there) of type `t`."""
    kind = t[0]
    if kind == "b":
        tok = t[1]
        if tok in INTS:
            lo, hi = INTS[tok]
            return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0]))
        if tok == "h":
            return st.integers(0, nfds - 1)  # an index into the descriptors sent
        if tok == "b":
            return st.booleans()
        if tok == "d":
            return st.floats(allow_nan=True, allow_infinity=True)
        if tok == "o":
            return object_paths
        if tok == "g":
            return st.lists(TYPES[nfds > 0], max_size=3).map(lambda ts: "".join(sig(x) for x in ts)).filter(
                lambda g: len(g) < 256)
        return strings
    if kind == "a":
        child = t[1]
        items = st.lists(values(child, nfds, depth + 1), max_size=5)
        if child[0] == "b" and child[1] in "ysu":  # big arrays, in one go
            item = {"y": st.integers(0, 255), "s": st.sampled_from(["", "x", "é"]),
                    "u": st.integers(0, 9)}[child[1]]
            width = {"y": 1, "s": 8, "u": 4}[child[1]]
            big = st.tuples(item, st.sampled_from(HUGE)).map(
                lambda vn: {"rep": [vn[0], vn[1] // width], "size": vn[1]})
            return rarely(big, items, 1 / 30)
        return items
    if kind == "e":
        key = values(("b", t[1]), nfds, depth + 1)
        return st.lists(st.tuples(key, values(t[2], nfds, depth + 1)).map(list), max_size=4)
    if kind == "r":
        return st.tuples(*(values(c, nfds, depth + 1) for c in t[1])).map(list)
    # A variant holds any type, its own variants too (not without end).
    inner = TYPES[nfds > 0] if depth < 6 else st.sampled_from("sub").map(lambda tok: ("b", tok))
    return inner.flatmap(lambda it: st.tuples(st.just(sig(it)), values(it, nfds, depth + 1)).map(list))


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    fds = draw(st.one_of(st.just([]), st.lists(st.sampled_from(["null", "pipe"]), max_size=MAX_MESSAGE_FDS)))
    target = draw(st.sampled_from(["ours", "ours", "ours", "standard", "standard", "made-up"]))
    known = ""
    if target == "ours":
        interface = draw(rarely(st.none(), st.just(IFACE), 1 / 5))
        member = draw(rarely(member_names, st.sampled_from(sorted(OURS)), 1 / 5))
        known = OURS.get(member, "")
    elif target == "standard":
        interface = draw(st.sampled_from(sorted(STANDARD)))
        member = draw(rarely(member_names, st.sampled_from(sorted(STANDARD[interface])), 1 / 5))
        known = STANDARD[interface].get(member, "")
    else:
        interface, member = draw(interface_names), draw(member_names)
    path = draw(rarely(object_paths, st.just(PATH), 1 / 5))
    if known and draw(rarely(st.just(False), st.just(True), 1 / 3)):
        arg_types = parse(known)
    else:
        arg_types = draw(st.lists(TYPES[bool(fds)], max_size=4).filter(
            lambda ts: len("".join(sig(t) for t in ts)) < 256))
    body = [draw(values(t, len(fds))) for t in arg_types]
    assume(_size(body) <= MAX_SIZE)
    signal = draw(rarely(st.just(True), st.just(False), 1 / 10))
    flags = draw(st.sampled_from([0] * 6 + [NO_REPLY_EXPECTED, ALLOW_INTERACTIVE_AUTHORIZATION,
                                           NO_REPLY_EXPECTED | ALLOW_INTERACTIVE_AUTHORIZATION,
                                           NO_AUTO_START]))
    return {
        "kind": "signal" if signal else "call",
        "dest": "unique" if signal or draw(st.booleans()) else IFACE,
        # A signal must name its interface.
        "path": path, "interface": (interface or IFACE) if signal else interface, "member": member,
        "signature": "".join(sig(t) for t in arg_types), "body": body,
        "fds": fds, "flags": flags, "timeout": 20,
    }


def _size(value: Any) -> int:
    """The bytes of a body's huge values (the rest is small)."""
    if isinstance(value, dict):
        return int(value.get("size", 0))
    if isinstance(value, list):
        return sum(_size(v) for v in value)
    return 0


@pytest.fixture
def fuzzed(make_agent: Callable[..., Agent], permissive_bus: Bus,
           testnet: Callable[..., Path]) -> Iterator[tuple[Agent, Stranger]]:
    testnet()
    agent = make_agent(bus=permissive_bus)
    stranger = Stranger(permissive_bus.address)
    yield agent, stranger
    stranger.close()


def call(member: str, signature: str, body: list[Any], interface: str | None = IFACE,
         fds: int = 0, flags: int = 0) -> dict[str, Any]:
    return {"kind": "call", "dest": IFACE, "path": PATH, "interface": interface, "member": member,
            "signature": signature, "body": body, "fds": ["null", "pipe"] * (fds // 2) + ["null"] * (fds % 2),
            "flags": flags, "timeout": 20}


def big(item: Any, size: int) -> dict[str, Any]:
    return {"rep": [item, size // max(1, len(str(item).encode()))], "size": size}


def nested_variant(depth: int) -> list[Any]:
    value: list[Any] = ["s", "bottom"]
    for _ in range(depth):
        value = ["v", value]
    return value


# The edges, every run: the bus's limits on size and descriptors, deep nesting,
# odd doubles, a read-only property set, a netns_fd that is /dev/null.
EXPLICIT = [
    call("Setup", "ssa{sv}", [big("x", 30 << 20), "/run/netns/x", []]),
    call("Ping", "ay", [big(7, 16 << 20)], interface=PEER, fds=MAX_MESSAGE_FDS),
    call("Setup", "ssa{sv}", ["deep", "/run/netns/x", [["pod", nested_variant(30)]]], fds=3),
    call("WaitReady", "d", [float("nan")], flags=ALLOW_INTERACTIVE_AUTHORIZATION),
    call("WaitReady", "d", [1e308], fds=1),
    call("Set", "ssv", [IFACE, "NetworkReady", ["b", False]], interface=PROPERTIES, fds=2),
    call("Setup", "ssa{sv}", ["fd", "/proc/self/ns/net", [["netns_fd", ["h", 0]]]], fds=MAX_MESSAGE_FDS,
         flags=ALLOW_INTERACTIVE_AUTHORIZATION),
    call("CNICall", "a{ss}s", [[["CNI_COMMAND", "ADD"], ["CNI_NETNS", "/proc/1/ns/net"]],
                               big("{", 1 << 20)], fds=4, flags=NO_REPLY_EXPECTED),
]


SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], print_blob=False,
                    suppress_health_check=list(HealthCheck))


def test_the_whole_surface_as_a_stranger(fuzzed: tuple[Agent, Stranger], netns: str) -> None:
    agent, stranger = fuzzed
    assert agent.proc is not None
    pid = agent.proc.pid
    assert stranger.send({"kind": "call", "member": "Ping", "interface": PEER})["outcome"] == "return"
    baseline_fds, baseline_rss = idle_fds(pid), rss_kib(pid)
    seen: collections.Counter[str] = collections.Counter()

    @SETTINGS
    @given(batch=st.lists(messages(), min_size=1, max_size=3))
    @example(batch=EXPLICIT)
    def fuzz(batch: list[dict[str, Any]]) -> None:
        for message in batch:
            answer = stranger.send(message)
            outcome = answer.get("error") or answer["outcome"]
            seen[f"{message['interface']}.{message['member']}: {outcome}"] += 1
            what = json.dumps({k: message[k] for k in ("interface", "member", "signature", "flags")})
            # Sent and answered: not refused by dbus-fast or the bus (the fuzz would be testing itself).
            assert answer["outcome"] in ("return", "error", "sent"), (what, answer)
            assert agent.proc is not None and agent.proc.poll() is None, \
                f"the agent exited after {what}:\n{agent.log()[-3000:]}"

    fuzz()
    print("\n".join(f"{n:5} {k}" for k, n in sorted(seen.items())))
    problems = []
    left = settle_fds(pid, baseline_fds)
    if left > baseline_fds:
        problems.append(f"the agent holds {left} descriptors, {baseline_fds} before; most: "
                        f"{fd_targets(pid).most_common(3)}")
    grown = rss_kib(pid) - baseline_rss
    if grown > RSS_GROWTH:
        problems.append(f"the agent's RSS grew by {grown / 1024:.1f} MiB (at most {RSS_GROWTH // 1024})")
    if "Traceback" in agent.log():
        tb = agent.log().index("Traceback")
        problems.append(f"a traceback in the agent's log:\n{agent.log()[tb - 100:tb + 1500]}")
    try:
        agent.setup("rootpod", netns)
        agent.call("Teardown", "ssa{sv}", "rootpod", netns, "0")
    except AssertionError as e:
        problems.append(f"root's Setup or Teardown failed: {str(e).splitlines()[0][-400:]}")
    assert not problems, "\n".join(problems)


def test_huge_messages_leave_no_memory_behind(fuzzed: tuple[Agent, Stranger]) -> None:
    """The bus passes a stranger's messages up to 32 MiB: once answered, the agent
    gives the memory back (the fuzz's RSS bound, one cause at a time)."""
    agent, stranger = fuzzed
    assert agent.proc is not None
    pid = agent.proc.pid
    status = [["CNI_COMMAND", "STATUS"]]
    kinds: dict[str, Callable[[int], dict[str, Any]]] = {
        "Show": lambda size: call("Show", "s", [big("x", size)]),
        "an unknown method": lambda size: call("Frobnicate", "s", [big("x", size)]),
        "Peer.Ping": lambda size: call("Ping", "ay", [big(1, size)], interface=PEER),
        "Setup": lambda size: call("Setup", "ssa{sv}", ["x", "/run/netns/x",
                                                        [["capabilities", ["s", big("{", size)]]]]),
        "CNICall STATUS": lambda size: call("CNICall", "a{ss}s", [status, big("{", size)]),
    }
    for make in kinds.values():  # every path taken once, small, before the baseline
        assert stranger.send(make(16))["outcome"] in ("return", "error")
    baseline = rss_kib(pid)
    after: dict[str, int] = {}
    for size in (30 << 20, 16 << 20):
        for name, make in kinds.items():
            answer = stranger.send(make(size))
            assert answer["outcome"] in ("return", "error"), (name, answer)
            # dbus-fast keeps the last message it read until the next one comes
            # (bounded by the bus's largest message): the next, small, frees it.
            assert stranger.send(make(16))["outcome"] in ("return", "error")
            after[f"{name} {size >> 20} MiB"] = (rss_kib(pid) - baseline) // 1024
    grown = (rss_kib(pid) - baseline) / 1024
    assert grown <= RSS_GROWTH / 1024, f"RSS grew by {grown:.0f} MiB (MiB after each kind: {after})"
