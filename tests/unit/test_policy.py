"""The one place that decides who may do what (sandboxes/policy.py), as tables."""

from __future__ import annotations

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.errors import InvalidArgument
from cni_agent.cni.pool import Pool
from cni_agent.sandboxes.policy import (
    METHODS,
    ROOT,
    Caller,
    Policy,
    Role,
    Scope,
    cnicall_scope,
)

MEMBER = Caller(1001, Role.MEMBER)
DELEGATE = Caller(1002, Role.DELEGATE)
STRANGER = Caller(65534, Role.STRANGER)


@pytest.mark.parametrize(("caller", "scope", "allowed"), [
    (ROOT, Scope.RUNTIME, True), (ROOT, Scope.NODE, True), (ROOT, Scope.MANAGE, True),
    (MEMBER, Scope.MANAGE, True), (MEMBER, Scope.INSPECT, True), (MEMBER, Scope.OPEN, True),
    (MEMBER, Scope.NODE, False), (MEMBER, Scope.RUNTIME, False),
    (DELEGATE, Scope.MANAGE, True), (DELEGATE, Scope.NODE, False),
    (STRANGER, Scope.OPEN, True), (STRANGER, Scope.INSPECT, False),
    (STRANGER, Scope.MANAGE, False), (STRANGER, Scope.NODE, False),
    (STRANGER, Scope.RUNTIME, False),
])
def test_who_may_call_each_scope(caller: Caller, scope: Scope, allowed: bool) -> None:
    assert Policy.permits(caller, scope) is allowed


def test_every_method_declares_its_scope() -> None:
    assert METHODS["Reload"] is METHODS["SetPodCIDRs"] is METHODS["ResetPodCIDRs"] is Scope.NODE
    assert METHODS["WaitReady"] is METHODS["NetworkCapacity"] is Scope.OPEN
    assert {m for m, s in METHODS.items() if s is Scope.INSPECT} == {
        "Show", "ListSandboxes", "Check", "WatchSandboxes"}
    assert cnicall_scope("STATUS") is cnicall_scope("VERSION") is Scope.OPEN
    assert {cnicall_scope(c) for c in ("ADD", "DEL", "CHECK", "GC", "", "BOGUS")} == {Scope.RUNTIME}


@pytest.mark.parametrize(("caller", "owners", "allowed"), [
    (ROOT, (), True), (ROOT, None, True),
    (MEMBER, (1001,), True), (MEMBER, (1001, 1001), True),
    (MEMBER, (), False),  # the node's own user namespace: root's ip netns add, runtimes' pods
    (MEMBER, None, False),  # unknown
    (MEMBER, (0,), False),  # a user-namespaced pod: the runtime's user namespace
    (MEMBER, (1001, 0), False),  # its own, but inside root's: not privileged over it
    (MEMBER, (1002,), False), (DELEGATE, (1002,), True),
])
def test_namespace_authority(caller: Caller, owners: tuple[int, ...] | None, allowed: bool) -> None:
    if allowed:
        Policy.netns(caller, owners)
    else:
        with pytest.raises(AgentError) as e:
            Policy.netns(caller, owners)
        assert e.value.kind is ErrorKind.ACCESS_DENIED


def test_ids_are_per_owner_and_root_keeps_out_of_theirs() -> None:
    assert Policy.qualify(ROOT, "web") == "web"
    assert Policy.qualify(MEMBER, "web") == "cni-agent.u1001.web"
    assert Policy.qualify(Caller(1002, Role.MEMBER), "web") != Policy.qualify(MEMBER, "web")
    assert Policy.shown(MEMBER, "cni-agent.u1001.web") == "web"
    assert Policy.shown(ROOT, "cni-agent.u1001.web") == "cni-agent.u1001.web"
    with pytest.raises(InvalidArgument):
        Policy.check_new_id("cni-agent.u1001.web")
    Policy.check_new_id("web")
    with pytest.raises(InvalidArgument, match="carry its uid"):
        Policy.qualify(MEMBER, "x" * 120)


@pytest.mark.parametrize(("caller", "owner", "allowed"), [
    (ROOT, None, True), (ROOT, 1001, True), (MEMBER, 1001, True),
    (MEMBER, None, False), (MEMBER, 0, False), (MEMBER, 1002, False),
])
def test_holding_a_sandbox(caller: Caller, owner: int | None, allowed: bool) -> None:
    if allowed:
        Policy.holds(caller, "s", owner)
    else:
        with pytest.raises(AgentError, match="is not one of uid"):
            Policy.holds(caller, "s", owner)


@pytest.mark.parametrize(("args", "opened", "allowed"), [
    ((("IP", "10.0.0.9"),), (), False),       # host-local's address: what `ips` sets
    ((("MAC", "02:00:00:00:00:09"),), (), False),
    ((("ip", "10.0.0.9"),), (), False),       # any spelling
    ((("IP", "10.0.0.9"),), ("ips",), True),  # opened by the admin
    ((("IgnoreUnknown", "1"), ("K8S_POD_NAME", "p")), (), True),
])
def test_args_that_do_what_a_capability_does_need_it_opened(
    args: tuple[tuple[str, str], ...], opened: tuple[str, ...], allowed: bool,
) -> None:
    policy = Policy.of(capabilities=opened)
    policy.capabilities(ROOT, {}, (("IP", "10.0.0.9"), ("MAC", "02:00:00:00:00:09")))
    if allowed:
        policy.capabilities(MEMBER, {}, args)
    else:
        with pytest.raises(AgentError, match="sets what capability") as e:
            policy.capabilities(MEMBER, {}, args)
        assert e.value.kind is ErrorKind.ACCESS_DENIED


@pytest.mark.parametrize(("sandbox_id", "cached", "allowed"), [
    ("cni-agent.u1001.vm1", True, True),    # its own id, record set aside: its entries
    ("cni-agent.u1001.vm1", False, False),  # nothing at all: nothing said about it
    ("cni-agent.u1002.vm1", True, False),   # another member's
    ("vm1", True, False),                   # root's (or another tool's)
])
def test_entries_without_a_record_are_the_member_whose_id_space_holds_them(
    sandbox_id: str, cached: bool, allowed: bool,
) -> None:
    if allowed:
        Policy.holds(MEMBER, sandbox_id, None, cached)
    else:
        with pytest.raises(AgentError, match="is not one of uid"):
            Policy.holds(MEMBER, sandbox_id, None, cached)


def test_a_new_id_is_anyones_but_cache_entries_without_a_record_are_roots() -> None:
    Policy.sandbox(MEMBER, "s", None)
    with pytest.raises(AgentError):
        Policy.sandbox(MEMBER, "s", None, foreign=True)
    Policy.sandbox(ROOT, "s", None, foreign=True)


@pytest.mark.parametrize(("caps", "allowed_caps", "error"), [
    ({}, (), None),
    ({"portMappings": [{"hostPort": 8080, "containerPort": 80}]}, (), "not allowed"),
    ({"bandwidth": {"ingressRate": 1}}, (), "not allowed"),
    ({"ips": ["10.0.0.9/24"]}, ("portMappings",), "not allowed"),
    ({"portMappings": [{"hostPort": 8080, "containerPort": 80}]}, ("portMappings",), None),
    ({"portMappings": [{"hostPort": 9090, "containerPort": 80}]}, ("portMappings",),
     r"access\.host_ports: 8000-8999"),
    ({"portMappings": [{"hostPort": 23, "containerPort": 22}]}, ("portMappings",),
     "23/tcp is not in a range"),
    ({"portMappings": [{"hostPort": 1023, "protocol": "udp"}]}, ("portMappings",), "1023/udp"),
])
def test_capabilities(caps: dict[str, object], allowed_caps: tuple[str, ...],
                      error: str | None) -> None:
    policy = Policy.of(capabilities=allowed_caps, host_ports=[(8000, 8999)])
    policy.capabilities(ROOT, caps)  # root: anything well-formed
    if error is None:
        policy.capabilities(MEMBER, caps)
    else:
        with pytest.raises(AgentError, match=error) as e:
            policy.capabilities(MEMBER, caps)
        assert e.value.kind is ErrorKind.ACCESS_DENIED


@pytest.mark.parametrize(("caps", "error"), [
    ({"portMappings": [{"hostPort": "80"}]}, "is not a port"),
    ({"portMappings": {"hostPort": 80}}, "must be a list"),
    ({"portMappings": [{"hostPort": 80, "protocol": "icmp"}]}, "is not one of tcp, udp"),
])
def test_malformed_port_mappings_are_refused_to_everyone(caps: dict[str, object],
                                                         error: str) -> None:
    # Root's are compared with every other sandbox's too (issue 44): read first.
    policy = Policy.of(capabilities=["portMappings"], host_ports=[(1, 65535)])
    for caller in (ROOT, MEMBER):
        with pytest.raises(InvalidArgument, match=error):
            policy.capabilities(caller, caps)


def test_networks_and_quota() -> None:
    policy = Policy.of(networks=["vmnet"], max_sandboxes=2)
    policy.network(MEMBER, "vmnet")
    policy.network(ROOT, "pods")
    with pytest.raises(AgentError, match=r"access\.networks: vmnet"):
        policy.network(MEMBER, "pods")
    with pytest.raises(AgentError, match=r"access\.networks: none"):
        Policy().network(DELEGATE, "vmnet")
    policy.quota(MEMBER, 1)
    policy.quota(ROOT, 100)
    with pytest.raises(AgentError) as e:
        policy.quota(MEMBER, 2)
    assert e.value.kind is ErrorKind.BUSY


def test_each_network_once_per_sandbox_for_callers_that_are_not_root() -> None:
    Policy.once_per_sandbox(ROOT, "p", ["pods", "pods", "pods"])  # root: today's behaviour
    Policy.once_per_sandbox(MEMBER, "vm1", ["pods", "vmnet"])
    for caller in (MEMBER, DELEGATE):
        with pytest.raises(InvalidArgument, match="network pods twice in sandbox vm1") as e:
            Policy.once_per_sandbox(caller, Policy.qualify(caller, "vm1"),
                                    ["pods", "vmnet", "pods"])
        assert e.value.field == "networks"


@pytest.mark.parametrize(("held", "adding", "allowed"), [
    (0, 3, True), (13, 3, True), (16, 0, True), (14, 3, False), (16, 1, False), (0, 17, False),
])
def test_max_attachments(held: int, adding: int, allowed: bool) -> None:
    policy = Policy.of(max_attachments=16)
    policy.attachments(ROOT, 1000, 5)
    if allowed:
        policy.attachments(DELEGATE, held, adding)
        return
    with pytest.raises(AgentError, match=r"the most access\.max_attachments allows \(16\)") as e:
        policy.attachments(MEMBER, held, adding)
    assert e.value.kind is ErrorKind.BUSY


@pytest.mark.parametrize(("share", "held", "adding", "allowed"), [
    (0.5, 5, 1, True), (0.5, 6, 1, False), (0.5, 4, 3, False), (0.0, 0, 1, False),
    (1.0, 11, 1, True), (0.25, 3, 0, True), (0.25, 3, 1, False),
])
def test_members_share_of_a_known_pool(share: float, held: int, adding: int,
                                       allowed: bool) -> None:
    policy = Policy.of(members_share=share)
    pool = Pool((12,))
    policy.addresses(ROOT, "pods", pool, 12, 1)  # root: its Setup is never refused for members
    policy.addresses(MEMBER, "pods", None, 10**6, 1)  # unknown pool: the per-uid caps alone
    if allowed:
        policy.addresses(MEMBER, "pods", pool, held, adding)
        return
    with pytest.raises(AgentError, match=rf"access\.members_share \({share:g}\)") as e:
        policy.addresses(DELEGATE, "pods", pool, held, adding)
    assert e.value.kind is ErrorKind.BUSY and "the rest is kept for root" in e.value.message
