"""Host ports as a grant, and the CNI_ARGS keys a caller that is not root may
pass (issue 44, items 2 and 4): the pure parts of sandboxes/policy.py and
config.py as tables, and `Admission`'s claims on a real store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cni.args import PodMeta
from cni_agent.cni.errors import InvalidArgument
from cni_agent.config import _CAPABILITY_ARGS, parse_port_range
from cni_agent.sandboxes.admission import Admission
from cni_agent.sandboxes.policy import (
    ARG_CAPABILITIES,
    ROOT,
    Caller,
    HostPort,
    Policy,
    Role,
    held_ports,
    host_port,
    normalize_host_ip,
    normalize_protocol,
    port_mappings,
)
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore

MEMBER = Caller(1001, Role.MEMBER)
OTHER = Caller(1002, Role.MEMBER)
DELEGATE = Caller(1003, Role.DELEGATE)


def mapping(port: int, protocol: object = "tcp", host_ip: object = None) -> dict[str, object]:
    entry: dict[str, object] = {"hostPort": port, "containerPort": 80, "protocol": protocol}
    if host_ip is not None:
        entry["hostIP"] = host_ip
    return {"portMappings": [entry]}


# --- normalization ------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "name"), [
    ("tcp", "tcp"), ("TCP", "tcp"), ("Tcp", "tcp"), ("6", "tcp"), (None, "tcp"), ("", "tcp"),
    ("udp", "udp"), ("UDP", "udp"), ("17", "udp"),
    ("sctp", "sctp"), ("SCTP", "sctp"), ("132", "sctp"),
])
def test_every_spelling_of_a_protocol_is_one_name(given: object, name: str) -> None:
    assert normalize_protocol(given) == name


@pytest.mark.parametrize("given", ["icmp", "47", "06", " tcp", "tcp6", "dccp", 6, True, ["tcp"]])
def test_an_unknown_protocol_is_invalid(given: object) -> None:
    with pytest.raises(InvalidArgument, match="portMappings protocol"):
        normalize_protocol(given)


@pytest.mark.parametrize(("given", "address"), [
    (None, ""), ("", ""), ("0.0.0.0", ""), ("::", ""),  # every address
    ("127.0.0.1", "127.0.0.1"), ("::ffff:10.0.0.1", "10.0.0.1"), ("FD00::0001", "fd00::1"),
])
def test_host_ips_are_compared_as_addresses(given: object, address: str) -> None:
    assert normalize_host_ip(given) == address


@pytest.mark.parametrize("given", ["localhost", "10.0.0.300", "10.0.0.0/24", 10])
def test_a_host_ip_that_is_no_address_is_invalid(given: object) -> None:
    with pytest.raises(InvalidArgument, match="hostIP"):
        normalize_host_ip(given)


def test_a_mapping_is_read_as_its_key_and_malformed_ones_refused() -> None:
    assert port_mappings({}) == frozenset()
    assert port_mappings(mapping(8080, "6", "0.0.0.0")) == {HostPort(8080, "tcp")}
    assert port_mappings({"portMappings": [{"hostPort": 53, "protocol": "UDP",
                                            "hostIP": "127.0.0.1"}]}) == {
        HostPort(53, "udp", "127.0.0.1")}
    for bad, words in (({"portMappings": {"hostPort": 80}}, "must be a list"),
                       ({"portMappings": ["80"]}, "must be an object"),
                       (mapping(0), "is not a port"), (mapping(65536), "is not a port"),
                       ({"portMappings": [{"hostPort": "80"}]}, "is not a port"),
                       (mapping(80, "gre"), "is not one of tcp, udp, sctp")):
        with pytest.raises(InvalidArgument, match=words):
            port_mappings(bad)


def test_a_record_holds_each_well_formed_entry() -> None:
    caps = {"portMappings": [{"hostPort": 80, "protocol": "icmp"}, {"hostPort": 81},
                             {"hostPort": 82, "protocol": "17"}]}
    assert held_ports(caps) == {HostPort(81, "tcp"), HostPort(82, "udp")}
    assert held_ports({"portMappings": "junk"}) == frozenset()


def test_keys_are_read_whatever_their_case_as_portmap_reads_them() -> None:
    # containerd's go-cni sends Go's field names; portmap (encoding/json) takes them.
    assert host_port({"HostPort": 18247, "ContainerPort": 80, "Protocol": "TCP",
                      "HostIP": "127.0.0.1"}) == HostPort(18247, "tcp", "127.0.0.1")
    assert port_mappings({"portMappings": [{"hostport": 8080, "PROTOCOL": "17"}]}) == \
        frozenset({HostPort(8080, "udp")})


# --- the conflict key --------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b", "conflict"), [
    (HostPort(80, "tcp"), HostPort(80, "tcp"), True),
    (HostPort(80, "tcp"), HostPort(80, "tcp", "10.0.0.1"), True),  # every address holds it
    (HostPort(80, "tcp", "10.0.0.1"), HostPort(80, "tcp"), True),
    (HostPort(80, "tcp", "10.0.0.1"), HostPort(80, "tcp", "10.0.0.1"), True),
    (HostPort(80, "tcp", "10.0.0.1"), HostPort(80, "tcp", "10.0.0.2"), False),
    (HostPort(80, "tcp", "10.0.0.1"), HostPort(80, "tcp", "fd00::1"), False),
    (HostPort(80, "tcp"), HostPort(80, "udp"), False),
    (HostPort(80, "tcp"), HostPort(81, "tcp"), False),
])
def test_two_mappings_conflict_on_host_ip_protocol_and_port(
    a: HostPort, b: HostPort, conflict: bool,
) -> None:
    assert a.conflicts(b) is conflict and b.conflicts(a) is conflict


# --- access.host_ports ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "parsed"), [
    ("8080", (8080, 8080)), ("20000-20999", (20000, 20999)), ("1-65535", (1, 65535)),
    ("80-80", (80, 80)),
])
def test_a_port_range_is_one_port_or_first_to_last(text: str, parsed: tuple[int, int]) -> None:
    assert parse_port_range(text) == parsed


@pytest.mark.parametrize(("text", "why"), [
    ("", "must be a port"), ("http", "must be a port"), ("80-", "must be a port"),
    ("-80", "must be a port"), ("1-2-3", "must be a port"), (" 80", "must be a port"),
    ("80 - 90", "must be a port"), ("+80", "must be a port"), ("٨٠", "must be a port"),
    ("0", "1 to 65535"), ("65536", "1 to 65535"), ("0-10", "1 to 65535"),
    ("2000-1000", "first port is above its last"),
])
def test_a_bad_port_range_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_port_range(text)


@pytest.mark.parametrize(("ranges", "port", "allowed"), [
    ((), 18080, False),  # opened portMappings, no range: nothing (it used to be ≥ 1024)
    (((20000, 20999),), 20000, True), (((20000, 20999),), 20999, True),
    (((20000, 20999),), 21000, False), (((20000, 20999),), 19999, False),
    (((8080, 8080), (20000, 20999)), 8080, True),
    (((80, 80),), 80, True),  # below 1024 only where the admin wrote it
    (((20000, 20999),), 23, False),
])
def test_a_member_maps_only_ports_inside_access_host_ports(
    ranges: tuple[tuple[int, int], ...], port: int, allowed: bool,
) -> None:
    policy = Policy.of(capabilities=["portMappings"], host_ports=ranges)
    for protocol in ("tcp", "6", "UDP"):
        caps = mapping(port, protocol)
        policy.capabilities(ROOT, caps)  # root: any port
        if allowed:
            policy.capabilities(MEMBER, caps)
            policy.capabilities(DELEGATE, caps)
        else:
            with pytest.raises(AgentError, match=r"not in a range open to callers that are not "
                                                 r"root \(access\.host_ports: ") as e:
                policy.capabilities(MEMBER, caps)
            assert e.value.kind is ErrorKind.ACCESS_DENIED
            assert f"host port {port}/{normalize_protocol(protocol)} " in e.value.message


def test_root_mappings_are_read_too_and_an_unknown_protocol_refused_for_everyone() -> None:
    policy = Policy.of(capabilities=["portMappings"], host_ports=[(1, 65535)])
    for caller in (ROOT, MEMBER):
        with pytest.raises(InvalidArgument, match="'icmp' is not one of tcp, udp, sctp"):
            policy.capabilities(caller, mapping(8080, "icmp"))


def test_a_taken_port_names_its_holder_to_root_alone() -> None:
    wanted, held = HostPort(8080, "tcp", "127.0.0.1"), HostPort(8080, "tcp")
    to_root = Policy.port_taken(ROOT, wanted, held, "cni-agent.u1001.vm1")
    assert str(to_root) == ("capabilities: host port 8080/tcp on 127.0.0.1 is already mapped by "
                            "sandbox cni-agent.u1001.vm1 as 8080/tcp")
    to_member = Policy.port_taken(MEMBER, held, held, "web")
    assert str(to_member) == "capabilities: host port 8080/tcp is already mapped by another sandbox"
    assert "web" not in str(to_member)


# --- access.cni_args ------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "pod", "listed", "refused"), [
    ((), None, (), None),
    ((("IgnoreUnknown", "1"),), None, (), None),  # always
    ((("IP", "10.0.0.9"),), None, (), None),  # its capability decides (`capabilities`)
    ((("FOO", "1"),), None, (), "argument FOO"),
    ((("FOO", "1"),), None, ("FOO",), None),
    ((("foo", "1"),), None, ("FOO",), "argument foo"),  # keys as plugins read them: exact
    ((("K8S_POD_NAMESPACE", "kube-system"),), None, (), "argument K8S_POD_NAMESPACE"),
    ((("K8S_POD_NAME", "coredns"),), None, ("K8S_POD_NAMESPACE",), "argument K8S_POD_NAME"),
    ((), PodMeta("kube-system", "coredns"), (), "option pod passes argument K8S_POD_NAMESPACE"),
    ((), PodMeta("ns", "p", "u-1"), ("K8S_POD_NAMESPACE", "K8S_POD_NAME",
                                    "K8S_POD_INFRA_CONTAINER_ID"), "argument K8S_POD_UID"),
    ((), PodMeta("ns", "p", "u-1"), ("K8S_POD_NAMESPACE", "K8S_POD_NAME",
                                    "K8S_POD_INFRA_CONTAINER_ID", "K8S_POD_UID"), None),
])
def test_cni_args_keys_are_the_admins_to_open(
    args: tuple[tuple[str, str], ...], pod: PodMeta | None, listed: tuple[str, ...],
    refused: str | None,
) -> None:
    policy = Policy.of(cni_args=listed)
    policy.arguments(ROOT, args, pod)
    policy.arguments(ROOT, (("K8S_POD_NAME", "x"), ("ANY", "y")), PodMeta("a", "b", "c"))
    for caller in (MEMBER, DELEGATE):
        if refused is None:
            policy.arguments(caller, args, pod)
            continue
        with pytest.raises(AgentError) as e:
            policy.arguments(caller, args, pod)
        assert e.value.kind is ErrorKind.ACCESS_DENIED
        assert refused in e.value.message and "access.cni_args: " in e.value.message


def test_the_config_refuses_the_keys_a_capability_opens_as_the_policy_reads_them() -> None:
    assert _CAPABILITY_ARGS == ARG_CAPABILITIES


# --- Admission: claims and records, root included ------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> SandboxStore:
    s = SandboxStore(str(tmp_path))
    s.open()
    return s


def record(sid: str, owner: int, caps: dict[str, object]) -> SandboxRecord:
    att = Attachment("pods", "eth0", b"{}", (), caps, Phase.READY)
    return SandboxRecord(sid, f"/run/netns/{sid}", None, (att,), owner=owner)


POLICY = Policy.of(networks=["pods"], capabilities=["portMappings"], host_ports=[(18000, 18999)])


async def test_root_never_takes_a_port_a_members_sandbox_maps(store: SandboxStore) -> None:
    store.write(record("cni-agent.u1001.vm1", 1001, mapping(18601, "6")))
    admission = Admission(store)
    with pytest.raises(InvalidArgument, match=r"18601/tcp is already mapped by sandbox "
                                              r"cni-agent\.u1001\.vm1$"):
        async with admission.admitted(ROOT, POLICY, "web", mapping(18601, "TCP"), True):
            pass
    # Another address of the same port is root's to map where the member's is on one address.
    store.write(record("cni-agent.u1001.vm1", 1001, mapping(18601, "tcp", "127.0.0.1")))
    async with admission.admitted(ROOT, POLICY, "web", mapping(18601, "tcp", "127.0.0.2"), True):
        pass
    with pytest.raises(InvalidArgument, match=r"as 18601/tcp on 127\.0\.0\.1"):
        async with admission.admitted(ROOT, POLICY, "web", mapping(18601, "tcp"), True):
            pass


async def test_a_member_learns_no_holder_and_its_own_sandbox_may_map_its_port_again(
    store: SandboxStore,
) -> None:
    store.write(record("web", 0, mapping(18602, "udp")))
    admission = Admission(store)
    with pytest.raises(InvalidArgument) as e:
        async with admission.admitted(MEMBER, POLICY, "cni-agent.u1001.vm1",
                                      mapping(18602, "17"), True):
            pass
    assert str(e.value) == "capabilities: host port 18602/udp is already mapped by another sandbox"
    # The holder itself (an Attach of another interface to it) is not in its own way.
    async with admission.admitted(ROOT, POLICY, "web", mapping(18602, "udp"), False):
        pass


async def test_two_calls_under_way_never_both_take_a_port(store: SandboxStore) -> None:
    admission = Admission(store)
    inside, release = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        async with admission.admitted(MEMBER, POLICY, "cni-agent.u1001.vm1",
                                      mapping(18603), True):
            inside.set()
            await release.wait()

    task = asyncio.create_task(first())
    await inside.wait()
    # Nothing is recorded yet: the claim alone refuses root's and another member's.
    for caller, sid in ((ROOT, "web"), (OTHER, "cni-agent.u1002.vm1")):
        with pytest.raises(InvalidArgument, match="18603/tcp is already mapped by"):
            async with admission.admitted(caller, POLICY, sid, mapping(18603, "6"), True):
                pass
    release.set()
    await task
    async with admission.admitted(ROOT, POLICY, "web", mapping(18603), True):
        pass  # the claim ended with its call


async def test_roots_calls_without_ports_claim_nothing(store: SandboxStore) -> None:
    admission = Admission(store)
    async with admission.admitted(ROOT, POLICY, "web", {}, True):
        assert admission._claims == {}
