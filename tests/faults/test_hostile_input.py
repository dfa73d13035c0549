"""Hostile input through D-Bus: every bad value is InvalidArgument naming the field,
and nothing is created on disk outside the agent's state and runtime dirs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dbus_fast import Variant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.agent import Agent
from tests.support.dbusclient import SyncClient
from tests.support.plugins import Control, ns_key
from tests.support.state import records

pytestmark = pytest.mark.root
INVALID = "org.cniagent.Agent1.Error.InvalidArgument"
SPEC_ID = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")
# Not /var/lib/cni/networks: host-local's dirs there are named by networks, which
# no input here names, and the tests running alongside add theirs.
WATCHED = [Path("/"), Path("/tmp"), Path("/run"), Path("/run/netns"), Path("/var/lib"),
           Path("/etc")]
# The tests running alongside add users and groups: shadow-utils' lock, temporary and
# backup files for its databases come and go in /etc (group.lock, gshadow.13296, passwd-).
USER_DB = re.compile(r"\.pwd\.lock|(passwd|shadow|group|gshadow|subuid|subgid)([-+]|\.lock|\.\d+)?")

# D-Bus strings are UTF-8 without NUL: everything else is fair game.
dbus_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
nasty = st.one_of(
    dbus_text,
    st.sampled_from(["../x", "../../etc/passwd", "a/b", "/abs", ".", "..", "a\nb", " a", "a ",
                     "ｓbx", "sbx\u200b", "ѕbx", "x" * 10_000, "-x", "_x", ";", "a;b=c", "${HOME}"]),
    st.builds(lambda a, b: a + b, dbus_text, st.sampled_from(["/..", "/", "\n", "\t", ";"])),
)


def snapshot(extra: list[Path]) -> dict[str, list[str]]:
    out = {}
    for d in WATCHED + extra:
        try:
            out[str(d)] = sorted(n for n in os.listdir(d)
                                 if d != Path("/etc") or not USER_DB.fullmatch(n))
        except FileNotFoundError:
            out[str(d)] = []
    return out


@pytest.fixture
def hostile(make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str,
            tmp_path: Path) -> Iterator[tuple[SyncClient, str, Path]]:
    testnet()
    agent = make_agent()
    client = SyncClient(agent.bus.address)
    state, run = tmp_path / "state", tmp_path / "run"
    before = snapshot([tmp_path])
    yield client, netns, tmp_path
    client.close()
    after = snapshot([tmp_path])
    # Other processes on the machine may come and go there (the agent never creates a netns).
    for d in ("/tmp", "/run", "/run/netns"):
        before.pop(d), after.pop(d)
    assert after == before
    # Nothing inside the agent's own dirs either: no records, cache entries or lock files.
    assert records(state) == {}
    assert list((state / "results").iterdir()) == []
    assert not (run / "locks").exists() or list((run / "locks").iterdir()) == []


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(sandbox_id=nasty)
def test_sandbox_ids(hostile: tuple[SyncClient, str, Path], sandbox_id: str) -> None:
    client, netns, _ = hostile
    err, body = client.call("Setup", "ssa{sv}", [sandbox_id, netns, {}])
    if SPEC_ID.fullmatch(sandbox_id) and len(sandbox_id) <= 128:
        assert err is None, body
        assert client.call("Teardown", "ssa{sv}", [sandbox_id, "", {}])[0] is None
    else:
        assert err == INVALID and body.startswith("sandbox_id:"), (err, body)
    for method in ("Show", "Teardown", "Check"):
        args = [sandbox_id] if method == "Show" else [sandbox_id, netns, {}]
        err, body = client.call(method, "s" if method == "Show" else "ssa{sv}", args)
        if not SPEC_ID.fullmatch(sandbox_id) or len(sandbox_id) > 128:
            assert err == INVALID and "sandbox_id" in body


@SETTINGS
@given(ifname=nasty)
def test_ifnames(hostile: tuple[SyncClient, str, Path], ifname: str) -> None:
    client, netns, _ = hostile
    opts = {"networks": Variant("a(ss)", [["testnet", ifname]])}
    err, body = client.call("Setup", "ssa{sv}", ["ifn", netns, opts])
    if err is None:
        assert client.call("Teardown", "ssa{sv}", ["ifn", "", {}])[0] is None
    elif ifname:
        assert err == INVALID and body.startswith("networks:"), (err, body)


@SETTINGS
@given(path=st.one_of(nasty, st.sampled_from([
    "/dev/null", "/dev/zero", "/etc/passwd", "/proc/self/ns/net", "/proc/1/ns/net",
    "/proc/self/ns/mnt", "/run/netns", "/", "/proc/self/fd/0", "/dev/stdin"])))
def test_netns_paths(hostile: tuple[SyncClient, str, Path], path: str) -> None:
    client, _, _ = hostile
    err, body = client.call("Setup", "ssa{sv}", ["nspath", path, {}])
    assert err == INVALID and body.startswith("netns:"), (path, err, body)


@SETTINGS
@given(key=nasty, value=nasty)
def test_args_cannot_inject_pairs(hostile: tuple[SyncClient, str, Path], key: str, value: str) -> None:
    client, netns, _ = hostile
    opts = {"args": Variant("a{ss}", {key: value})}
    err, body = client.call("Setup", "ssa{sv}", ["args", netns, opts])
    if err is None:
        # Accepted only when it cannot split into more pairs.
        assert ";" not in value and re.fullmatch(r"[A-Za-z0-9_.\-]+", key)
        assert client.call("Teardown", "ssa{sv}", ["args", "", {}])[0] is None
    else:
        assert err == INVALID and body.startswith("args:"), (err, body)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("caps", [
    "[1, 2]", '"a string"', "42", "null", "{not json", "{" + '"a":' * 10 + "1" + "}" * 10,
    '{"deep": ' + _nested(100) + "}", _nested(100_000),
    json.dumps({"portMappings": ["x" * 1000] * 3000}),
])
def test_capabilities_that_are_not_a_small_object(
    hostile: tuple[SyncClient, str, Path], caps: str
) -> None:
    client, netns, _ = hostile
    err, body = client.call("Setup", "ssa{sv}", ["caps", netns,
                                                  {"capabilities": Variant("s", caps)}])
    assert err == INVALID and body.startswith("options.capabilities:"), (err, body[:200])


@pytest.mark.parametrize(("member", "signature", "body"), [
    ("Setup", "sss", ["a", "b", "c"]),
    ("Setup", "ssa{ss}", ["a", "b", {"x": "y"}]),
    ("Teardown", "s", ["a"]),
    ("GarbageCollect", "s", ["a"]),
    ("SetPodCIDRs", "ai", [[1]]),
    ("WaitReady", "i", [5]),
    ("ListSandboxes", "s", ["x"]),
])
def test_wrong_signatures(hostile: tuple[SyncClient, str, Path], member: str, signature: str,
                          body: list[object]) -> None:
    client, _, _ = hostile
    err, text = client.call(member, signature, body)
    assert err == INVALID and f"{member} takes arguments" in text


# --- indirection: symlinked, swapped and bind-mounted netns paths --------------------

# The agent runs in the host's namespace, as this test does (pid 1's may be closed to us).
HOST_NETNS = f"/proc/{os.getpid()}/ns/net"


@SETTINGS
@given(kind=st.sampled_from(["symlink", "bind", "swapped", "symlink-host", "bind-host",
                             "symlink-mnt", "dangling", "loop"]),
       depth=st.integers(1, 4))
def test_netns_indirection(hostile: tuple[SyncClient, str, Path], control: Control,
                           kind: str, depth: int) -> None:
    """Links and bind mounts are followed once; what they name then is all that counts.
    No plugin ever runs in the host's namespace."""
    client, netns, _ = hostile
    scratch = Path(tempfile.mkdtemp(prefix="cni-agent-hostile-"))
    mounted: list[Path] = []
    try:
        target = {"symlink": netns, "swapped": netns, "bind": netns, "symlink-host": HOST_NETNS,
                  "bind-host": "/proc/self/ns/net", "symlink-mnt": f"/proc/{os.getpid()}/ns/mnt",
                  "dangling": str(scratch / "nothing"), "loop": str(scratch / "l0")}[kind]
        if kind.startswith("bind"):
            path = scratch / "bound"
            path.touch()
            subprocess.run(["mount", "--bind", target, str(path)], check=True)
            mounted.append(path)
        else:
            path = scratch / f"l{depth}"
            for i in range(depth, 0, -1):  # l_depth -> ... -> l1 -> target
                (scratch / f"l{i}").symlink_to(scratch / f"l{i - 1}" if i > 1 else target)
        err, body = client.call("Setup", "ssa{sv}", ["ind", str(path), {}])
        if kind in ("symlink", "bind", "swapped"):
            assert err is None, body
            if kind == "swapped":  # the path now names the host's namespace
                (scratch / "l1").unlink()
                (scratch / "l1").symlink_to(HOST_NETNS)
                err, body = client.call("Check", "ssa{sv}", ["ind", str(path), {}])
                assert err == INVALID and "agent's own network namespace" in body, body
            assert client.call("Teardown", "ssa{sv}", ["ind", "", {}])[0] is None
        else:
            assert err == INVALID and body.startswith("netns:"), (kind, err, body)
        host = ns_key(HOST_NETNS)
        assert all(r["netns_ino"] != host for r in control.records(None)), "ran in the host netns"
    finally:
        for m in mounted:
            subprocess.run(["umount", str(m)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
