"""Identifier validation and CNI_ARGS construction."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni_agent.cni.args import (
    MAX_CONTAINER_ID,
    PodMeta,
    build_cni_args,
    format_cni_args,
    validate_container_id,
    validate_ifname,
    validate_network_name,
)
from cni_agent.cni.errors import InvalidArgument

SPEC_ID = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")


@pytest.mark.parametrize("good", ["a", "abc123", "0_x.y-z", "f" * MAX_CONTAINER_ID])
def test_valid_container_ids(good: str) -> None:
    assert validate_container_id(good) == good


@pytest.mark.parametrize(
    "bad", ["", "-x", ".hidden", "..", "../etc", "a/b", "a b", "a\nb", "a\x00b",
            "f" * (MAX_CONTAINER_ID + 1), "ünicode", "a;b", "ａbc"],
)
def test_invalid_container_ids_name_the_field(bad: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validate_container_id(bad)
    assert e.value.field == "sandbox_id"


@given(st.text(max_size=200))
def test_container_id_accepts_exactly_the_spec_pattern(s: str) -> None:
    ok = bool(SPEC_ID.fullmatch(s)) and len(s) <= MAX_CONTAINER_ID
    try:
        validate_container_id(s)
    except InvalidArgument:
        assert not ok
    else:
        assert ok
        # Whatever passes is a single safe path component.
        assert "/" not in s and s not in (".", "..") and "\x00" not in s


@pytest.mark.parametrize("good", ["eth0", "net1", "a" * 15, "veth-x_y.z"])
def test_valid_ifnames(good: str) -> None:
    assert validate_ifname(good) == good


@pytest.mark.parametrize("bad", ["", ".", "..", "a" * 16, "eth/0", "eth:0", "eth 0", "eth\t0",
                                 "e\x00", "ethé0123456789"])
def test_invalid_ifnames(bad: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validate_ifname(bad)
    assert e.value.field == "ifname"


@given(st.text(max_size=40))
def test_ifname_rules_hold_for_any_string(s: str) -> None:
    try:
        validate_ifname(s)
    except InvalidArgument:
        return
    assert 0 < len(s.encode()) <= 15
    assert s not in (".", "..")
    assert not any(c in "/:" or c.isspace() for c in s)


def test_network_name_rules() -> None:
    assert validate_network_name("bridge-firewalld") == "bridge-firewalld"
    with pytest.raises(InvalidArgument):
        validate_network_name("has space")


def test_args_pass_through_as_given_without_kubernetes() -> None:
    pairs = build_cni_args([("IP", "10.1.2.3"), ("FOO", "a=b")], None, "sbx")
    assert pairs == [("IP", "10.1.2.3"), ("FOO", "a=b")]
    assert format_cni_args(pairs) == "IP=10.1.2.3;FOO=a=b"
    assert build_cni_args([], None, "sbx") == []


def test_pod_metadata_adds_kubernetes_args() -> None:
    pairs = build_cni_args([("X", "1")], PodMeta("ns", "web", "u-1"), "sbx1")
    assert pairs == [
        ("IgnoreUnknown", "1"), ("K8S_POD_NAMESPACE", "ns"), ("K8S_POD_NAME", "web"),
        ("K8S_POD_INFRA_CONTAINER_ID", "sbx1"), ("K8S_POD_UID", "u-1"), ("X", "1"),
    ]
    without_uid = dict(build_cni_args([], PodMeta("ns", "web"), "sbx1"))
    assert "K8S_POD_UID" not in without_uid


@pytest.mark.parametrize(
    ("key", "value"),
    [("A;B", "1"), ("A=B", "1"), ("", "1"), ("A", "1;B=2"), ("A", "x\x00"), ("A", "x\ny"),
     ("A B", "1"), ("K", "v" * 5000)],
)
def test_injection_is_refused(key: str, value: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        build_cni_args([(key, value)], None, "sbx")
    assert e.value.field == "args"


def test_pod_values_cannot_inject() -> None:
    with pytest.raises(InvalidArgument) as e:
        build_cni_args([], PodMeta("ns;EVIL=1", "x"), "sbx")
    assert e.value.field == "pod"


@given(st.lists(st.tuples(st.text(max_size=20), st.text(max_size=40)), max_size=5))
def test_formatted_args_parse_back_to_the_same_pairs(pairs: list[tuple[str, str]]) -> None:
    try:
        built = build_cni_args(pairs, None, "sbx")
    except InvalidArgument:
        return
    text = format_cni_args(built)
    parsed = [tuple(p.split("=", 1)) for p in text.split(";")] if text else []
    assert parsed == built
