"""CNI result validation and version conversion (libcni's rules)."""

from __future__ import annotations

import copy
import ipaddress
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cni_agent.cni.errors import ResultError
from cni_agent.cni.result import (
    SUPPORTED_VERSIONS,
    convert_result,
    parse_result,
    version_at_least,
    version_key,
)

LEGACY = ("0.1.0", "0.2.0")
V04 = ("0.3.0", "0.3.1", "0.4.0")
V1 = ("1.0.0", "1.1.0")

R11: dict[str, Any] = {
    "cniVersion": "1.1.0",
    "interfaces": [
        {"name": "cni0", "mac": "0a:58:0a:00:00:01"},
        {
            "name": "eth0",
            "mac": "0a:58:0a:00:00:05",
            "sandbox": "/var/run/netns/pod",
            "mtu": 1450,
            "socketPath": "/run/vhost.sock",
            "pciID": "0000:00:1f.6",
        },
    ],
    "ips": [
        {"address": "2001:db8::5/64", "gateway": "2001:db8::1", "interface": 1},
        {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
        {"address": "10.0.1.5/24", "interface": 1},
        {"address": "2001:db8:1::5/64"},
    ],
    "routes": [
        {"dst": "::/0", "gw": "2001:db8::1"},
        {"dst": "0.0.0.0/0", "gw": "10.0.0.1", "mtu": 1400, "table": 100},
        {"dst": "192.168.0.0/16"},
    ],
    "dns": {"nameservers": ["10.0.0.53"], "domain": "cluster.local", "search": ["svc"]},
}

R04_EXPECTED: dict[str, Any] = {
    "cniVersion": "0.4.0",
    "interfaces": [
        {"name": "cni0", "mac": "0a:58:0a:00:00:01"},
        {"name": "eth0", "mac": "0a:58:0a:00:00:05", "sandbox": "/var/run/netns/pod"},
    ],
    "ips": [
        {"version": "6", "address": "2001:db8::5/64", "gateway": "2001:db8::1", "interface": 1},
        {"version": "4", "address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": 1},
        {"version": "4", "address": "10.0.1.5/24", "interface": 1},
        {"version": "6", "address": "2001:db8:1::5/64"},
    ],
    # libcni shares the route type for 0.3+ results: 1.1 route attributes stay
    "routes": R11["routes"],
    "dns": R11["dns"],
}

R02_EXPECTED: dict[str, Any] = {
    "cniVersion": "0.2.0",
    "ip4": {
        "ip": "10.0.0.5/24",
        "gateway": "10.0.0.1",
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}, {"dst": "192.168.0.0/16"}],
    },
    "ip6": {
        "ip": "2001:db8::5/64",
        "gateway": "2001:db8::1",
        "routes": [{"dst": "::/0", "gw": "2001:db8::1"}],
    },
    "dns": R11["dns"],
}


def with_version(result: dict[str, Any], version: str) -> dict[str, Any]:
    return {**copy.deepcopy(result), "cniVersion": version}


# --- versions -----------------------------------------------------------------


def test_version_helpers() -> None:
    assert version_key("0.3.1") == (0, 3, 1)
    assert version_at_least("1.0.0", "0.4.0")
    assert not version_at_least("0.3.1", "0.4.0")
    with pytest.raises(ResultError, match=r"invalid version 'x\.y'"):
        version_key("x.y")


# --- parse_result -------------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_result_without_version_takes_config_version(version: str) -> None:
    assert parse_result({}, version) == {"cniVersion": version}
    assert parse_result({"cniVersion": ""}, version) == {"cniVersion": version}


def test_result_version_wins_over_config_version() -> None:
    parsed = parse_result({"cniVersion": "0.2.0", "ip4": {"ip": "10.0.0.5/24"}}, "1.0.0")
    assert parsed == {"cniVersion": "0.2.0", "ip4": {"ip": "10.0.0.5/24"}}


@pytest.mark.parametrize(
    ("data", "config", "needle"),
    [
        ({"cniVersion": "0.5.0"}, "1.0.0", "'0.5.0'"),
        ({"cniVersion": "2.0.0"}, "1.0.0", "'2.0.0'"),
        ({}, "9.9.9", "'9.9.9'"),
        ({"cniVersion": 1}, "1.0.0", "must be a string"),
    ],
)
def test_unsupported_version(data: dict[str, Any], config: str, needle: str) -> None:
    with pytest.raises(ResultError, match="result version") as err:
        parse_result(data, config)
    assert needle in str(err.value)


@pytest.mark.parametrize("data", [None, [], "{}", 3])
def test_result_not_an_object(data: Any) -> None:
    with pytest.raises(ResultError, match="expected a JSON object"):
        parse_result(data, "1.0.0")


def test_parse_keeps_valid_results_and_does_not_mutate() -> None:
    for version in SUPPORTED_VERSIONS:
        source = R02_EXPECTED if version in LEGACY else R04_EXPECTED if version in V04 else R11
        data = with_version(source, version)
        before = copy.deepcopy(data)
        parsed = parse_result(data, "1.0.0")
        assert parsed == data
        assert data == before
        parsed["dns"]["nameservers"].append("x")
        assert data == before  # a deep copy


def test_parse_normalises() -> None:
    data = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "mac": None}],
        "ips": [
            {"address": "2001:DB8:0::5/64", "gateway": "", "version": "6"},
            {"address": "10.0.0.5/24", "gateway": "10.0.0.1", "interface": None},
        ],
        "routes": [],
        "dns": {"nameservers": [], "domain": ""},
        "vendorKey": {"kept": True},
    }
    assert parse_result(data, "1.0.0") == {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0"}],
        "ips": [{"address": "2001:db8::5/64"}, {"address": "10.0.0.5/24", "gateway": "10.0.0.1"}],
        "vendorKey": {"kept": True},
    }


def test_parse_keeps_unknown_keys_at_every_level() -> None:
    data = {
        "cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0", "x-if": 1}],
        "ips": [{"version": "4", "address": "10.0.0.5/24", "x-ip": [1]}],
        "routes": [{"dst": "0.0.0.0/0", "x-route": "r"}],
        "dns": {"x-dns": "d"},
        "x-top": None,
        "x-other": "o",
    }
    expected = {k: v for k, v in data.items() if k != "x-top"}
    assert parse_result(data, "0.4.0") == expected


def test_ipv4_mapped_address_counts_as_ipv4_like_libcni() -> None:
    data = {"cniVersion": "1.0.0", "ips": [{"address": "::ffff:10.0.0.5/120"}]}
    address = str(ipaddress.ip_interface("::ffff:10.0.0.5/120"))  # rendering varies by Python
    assert convert_result(data, "0.4.0")["ips"] == [{"version": "4", "address": address}]
    assert convert_result(data, "0.2.0") == {"cniVersion": "0.2.0", "ip4": {"ip": address}}


BAD_RESULTS: list[tuple[str, dict[str, Any], str]] = [
    ("1.0.0", {"ips": {"address": "10.0.0.5/24"}}, r"^ips: expected a list, got dict"),
    ("1.0.0", {"ips": ["10.0.0.5/24"]}, r"^ips\[0\]: expected an object, got str"),
    ("1.0.0", {"ips": [{"gateway": "10.0.0.1"}]}, r"^ips\[0\]: missing 'address'"),
    ("1.0.0", {"ips": [{"address": "10.0.0.5"}]}, r"ips\[0\]\.address: '10.0.0.5' is not a CIDR"),
    ("1.0.0", {"ips": [{"address": "10.0.0.500/24"}]}, r"is not a CIDR"),
    ("1.0.0", {"ips": [{"address": "10.0.0.5/33"}]}, r"is not a CIDR"),
    ("1.0.0", {"ips": [{"address": "10.0.0.5/255.255.255.0"}]}, r"is not a CIDR"),
    ("1.0.0", {"ips": [{"address": "fe80::1%eth0/64"}]}, r"is not a CIDR"),
    ("1.0.0", {"ips": [{"address": 167772165}]}, r"address: expected a string, got int"),
    ("1.0.0", {"ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0"}]},
     r"ips\[0\]\.gateway: '10.0.0' is not an IP address"),
    ("1.0.0", {"ips": [{"address": "10.0.0.5/24", "interface": 0}]},
     r"ips\[0\]\.interface: index 0 out of range \(the result has 0 interfaces\)"),
    ("1.0.0", {"interfaces": [{"name": "eth0"}], "ips": [{"address": "10.0.0.5/24",
                                                           "interface": -1}]}, r"index -1 out"),
    ("1.0.0", {"interfaces": [{"name": "eth0"}], "ips": [{"address": "10.0.0.5/24",
                                                           "interface": True}]}, r"index True"),
    ("1.0.0", {"interfaces": [{"name": "eth0"}], "ips": [{"address": "10.0.0.5/24",
                                                           "interface": "0"}]}, r"index '0'"),
    ("1.0.0", {"interfaces": [{"mac": "aa"}]}, r"interfaces\[0\]\.name: expected a non-empty"),
    ("1.0.0", {"interfaces": [{"name": ""}]}, r"interfaces\[0\]\.name: expected a non-empty"),
    ("1.0.0", {"interfaces": [{"name": "eth0", "mac": 5}]}, r"interfaces\[0\]\.mac: expected a"),
    ("1.1.0", {"interfaces": [{"name": "eth0", "mtu": "1500"}]}, r"interfaces\[0\]\.mtu"),
    ("1.1.0", {"interfaces": [{"name": "eth0", "pciID": 3}]}, r"interfaces\[0\]\.pciID"),
    ("1.0.0", {"interfaces": "eth0"}, r"^interfaces: expected a list"),
    ("1.0.0", {"routes": [{"gw": "10.0.0.1"}]}, r"^routes\[0\]: missing 'dst'"),
    ("1.0.0", {"routes": [{"dst": "default"}]}, r"routes\[0\]\.dst: 'default' is not a CIDR"),
    ("1.1.0", {"routes": [{"dst": "0.0.0.0/0", "table": -1}]}, r"routes\[0\]\.table: expected"),
    ("1.1.0", {"routes": [{"dst": "0.0.0.0/0", "mtu": 1.5}]}, r"routes\[0\]\.mtu: expected"),
    ("1.0.0", {"dns": ["10.0.0.53"]}, r"^dns: expected an object, got list"),
    ("1.0.0", {"dns": {"nameservers": "10.0.0.53"}}, r"dns\.nameservers: expected a list"),
    ("1.0.0", {"dns": {"search": [1]}}, r"dns\.search\[0\]: expected a string"),
    ("0.4.0", {"ips": [{"address": "10.0.0.5/24"}]}, r'ips\[0\]\.version: expected "4" or "6"'),
    ("0.3.1", {"ips": [{"version": 4, "address": "10.0.0.5/24"}]}, r"got 4$"),
    ("0.3.0", {"ips": [{"version": "6", "address": "10.0.0.5/24"}]},
     r"ips\[0\]\.version: '6' but '10.0.0.5/24' is IPv4"),
    ("0.4.0", {"ip4": {"ip": "10.0.0.5/24"}}, r"0\.4\.0 result has ip4, which belong"),
    ("0.2.0", {"ips": [], "routes": []}, r"0\.2\.0 result has ips, routes, which belong"),
    ("0.2.0", {"ip4": {"ip": "2001:db8::5/64"}}, r"ip4\.ip: '2001:db8::5/64' is not an IPv4"),
    ("0.1.0", {"ip6": {"ip": "10.0.0.5/24"}}, r"ip6\.ip: '10.0.0.5/24' is not an IPv6"),
    ("0.2.0", {"ip4": {"gateway": "10.0.0.1"}}, r"^ip4: missing 'ip'"),
    ("0.2.0", {"ip4": "10.0.0.5/24"}, r"^ip4: expected an object"),
    ("0.2.0", {"ip4": {"ip": "10.0.0.5/24", "routes": [{"dst": "x"}]}},
     r"ip4\.routes\[0\]\.dst: 'x' is not a CIDR"),
]


@pytest.mark.parametrize(("version", "data", "pattern"), BAD_RESULTS)
def test_bad_shapes_are_rejected(version: str, data: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ResultError, match=pattern):
        parse_result(data, version)


# --- convert_result: exact conversions ----------------------------------------


@pytest.mark.parametrize(
    "source", [R11, with_version(R11, "1.0.0"), R04_EXPECTED, R02_EXPECTED,
               with_version(R02_EXPECTED, "0.1.0"), with_version(R04_EXPECTED, "0.3.0")],
)
def test_same_version_is_an_equal_copy(source: dict[str, Any]) -> None:
    out = convert_result(source, source["cniVersion"])
    assert out == source
    assert out is not source
    out["dns"]["search"] = ["changed"]
    assert source["dns"]["search"] == ["svc"]


@pytest.mark.parametrize(
    ("source", "family"), [(R11, V1), (R04_EXPECTED, V04), (R02_EXPECTED, LEGACY)]
)
def test_within_a_family_only_the_version_changes(
    source: dict[str, Any], family: tuple[str, ...]
) -> None:
    extra = {**source, "x-vendor": {"a": 1}}
    for src in family:
        for dst in family:
            assert convert_result(with_version(extra, src), dst) == with_version(extra, dst)


def test_1x_to_04_adds_version_and_drops_new_interface_fields() -> None:
    for src in V1:
        for dst in V04:
            assert convert_result(with_version(R11, src), dst) == with_version(R04_EXPECTED, dst)


def test_04_to_1x_drops_version() -> None:
    expected = with_version(R11, "1.0.0")
    expected["interfaces"][1] = R04_EXPECTED["interfaces"][1]  # mtu, socketPath, pciID are gone
    for src in V04:
        assert convert_result(with_version(R04_EXPECTED, src), "1.0.0") == expected


def test_down_to_legacy_keeps_first_address_of_each_family() -> None:
    for src in (*V1, *V04):
        source = R11 if src in V1 else R04_EXPECTED
        for dst in LEGACY:
            got = convert_result(with_version(source, src), dst)
            assert got == with_version(R02_EXPECTED, dst)


def test_down_to_legacy_drops_routes_of_a_family_without_address() -> None:
    data = {
        "cniVersion": "1.0.0",
        "ips": [{"address": "10.0.0.5/24"}],
        "routes": [{"dst": "::/0"}, {"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 5}],
    }
    assert convert_result(data, "0.2.0") == {
        "cniVersion": "0.2.0",
        "ip4": {"ip": "10.0.0.5/24", "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}]},
    }


@pytest.mark.parametrize("src", [*V04, *V1])
@pytest.mark.parametrize("dst", LEGACY)
def test_down_to_legacy_without_ip_fails(src: str, dst: str) -> None:
    data = {"cniVersion": src, "interfaces": [{"name": "eth0"}], "routes": [{"dst": "::/0"}]}
    with pytest.raises(ResultError, match=f"cannot convert result to {dst}: it has no IP"):
        convert_result(data, dst)


def test_up_from_legacy() -> None:
    ips = [
        {"address": "10.0.0.5/24", "gateway": "10.0.0.1"},
        {"address": "2001:db8::5/64", "gateway": "2001:db8::1"},
    ]
    routes = [
        {"dst": "0.0.0.0/0", "gw": "10.0.0.1"},
        {"dst": "192.168.0.0/16"},
        {"dst": "::/0", "gw": "2001:db8::1"},
    ]
    for src in LEGACY:
        source = with_version(R02_EXPECTED, src)
        for dst in V1:
            assert convert_result(source, dst) == {
                "cniVersion": dst, "ips": ips, "routes": routes, "dns": R11["dns"]
            }
        for dst in V04:
            assert convert_result(source, dst) == {
                "cniVersion": dst,
                "ips": [{"version": "4", **ips[0]}, {"version": "6", **ips[1]}],
                "routes": routes,
                "dns": R11["dns"],
            }


def test_up_from_legacy_with_one_family_and_nothing_else() -> None:
    assert convert_result({"cniVersion": "0.1.0", "ip6": {"ip": "2001:db8::5/64"}}, "1.1.0") == {
        "cniVersion": "1.1.0", "ips": [{"address": "2001:db8::5/64"}]
    }
    assert convert_result({"cniVersion": "0.2.0"}, "0.4.0") == {"cniVersion": "0.4.0"}


def test_cross_family_drops_unknown_keys() -> None:
    data = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "x-if": 1}],
        "ips": [{"address": "10.0.0.5/24", "x-ip": 1}],
        "dns": {"domain": "d", "x-dns": 1},
        "x-top": 1,
    }
    assert convert_result(data, "0.4.0") == {
        "cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0"}],
        "ips": [{"version": "4", "address": "10.0.0.5/24"}],
        "dns": {"domain": "d"},
    }


@pytest.mark.parametrize("src", SUPPORTED_VERSIONS)
def test_round_trip_through_every_version(src: str) -> None:
    """Exactly what survives R11 -> src -> 1.1.0."""
    interfaces_04 = R04_EXPECTED["interfaces"]
    if src in V1:
        expected = R11
    elif src in V04:
        expected = {**R11, "interfaces": interfaces_04}
    else:  # no interfaces, so no interface index; routes regrouped v4 first
        expected = {
            "cniVersion": "1.1.0",
            "ips": [
                {"address": "10.0.0.5/24", "gateway": "10.0.0.1"},
                {"address": "2001:db8::5/64", "gateway": "2001:db8::1"},
            ],
            "routes": [
                {"dst": "0.0.0.0/0", "gw": "10.0.0.1"},
                {"dst": "192.168.0.0/16"},
                {"dst": "::/0", "gw": "2001:db8::1"},
            ],
            "dns": R11["dns"],
        }
    assert convert_result(convert_result(R11, src), "1.1.0") == expected


def test_convert_errors() -> None:
    with pytest.raises(ResultError, match=r"unsupported target version '0\.5\.0'"):
        convert_result(R11, "0.5.0")
    with pytest.raises(ResultError, match="without cniVersion"):
        convert_result({"ips": []}, "1.0.0")
    with pytest.raises(ResultError, match=r"ips\[0\]\.address"):
        convert_result({"cniVersion": "1.0.0", "ips": [{"address": "bad"}]}, "0.4.0")
    with pytest.raises(ResultError, match=r"unsupported result version '7\.0\.0'"):
        convert_result({"cniVersion": "7.0.0"}, "1.0.0")


def test_convert_does_not_mutate_input() -> None:
    before = copy.deepcopy(R11)
    for version in SUPPORTED_VERSIONS:
        convert_result(R11, version)
    assert before == R11


# --- property-based -----------------------------------------------------------


def _cidr(version: Literal[4, 6]) -> st.SearchStrategy[str]:
    bits = 32 if version == 4 else 128
    return st.builds(
        lambda ip, prefix: str(ipaddress.ip_interface(f"{ip}/{prefix}")),
        st.ip_addresses(v=version).filter(
            lambda ip: not isinstance(ip, ipaddress.IPv6Address) or ip.ipv4_mapped is None
        ),
        st.integers(0, bits),
    )


_ANY_CIDR = st.one_of(_cidr(4), _cidr(6))
_NAME = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=15)


def _maybe(draw: st.DrawFn, key: str, strategy: st.SearchStrategy[Any]) -> dict[str, Any]:
    return {key: draw(strategy)} if draw(st.booleans()) else {}


@st.composite
def results_100(draw: st.DrawFn) -> dict[str, Any]:
    interfaces = [
        {
            "name": draw(_NAME),
            **_maybe(draw, "mac", st.just("0a:58:0a:00:00:05")),
            **_maybe(draw, "sandbox", st.just("/var/run/netns/x")),
            **_maybe(draw, "mtu", st.integers(1, 65535)),
            **_maybe(draw, "socketPath", st.just("/run/sock")),
            **_maybe(draw, "pciID", st.just("0000:00:1f.6")),
        }
        for _ in range(draw(st.integers(0, 3)))
    ]
    ips = []
    for _ in range(draw(st.integers(0, 4))):
        version: Literal[4, 6] = draw(st.sampled_from([4, 6]))
        ipc: dict[str, Any] = {"address": draw(_cidr(version))}
        ipc.update(_maybe(draw, "gateway", st.ip_addresses(v=version).map(str)))
        if interfaces:
            ipc.update(_maybe(draw, "interface", st.integers(0, len(interfaces) - 1)))
        ips.append(ipc)
    routes = [
        {"dst": draw(_ANY_CIDR), **_maybe(draw, "gw", st.ip_addresses().map(str))}
        for _ in range(draw(st.integers(0, 3)))
    ]
    dns = {
        **_maybe(draw, "nameservers", st.lists(st.ip_addresses().map(str), min_size=1)),
        **_maybe(draw, "domain", _NAME),
        **_maybe(draw, "search", st.lists(_NAME, min_size=1)),
        **_maybe(draw, "options", st.lists(_NAME, min_size=1)),
    }
    result: dict[str, Any] = {"cniVersion": "1.0.0"}
    for key, value in (("interfaces", interfaces), ("ips", ips), ("routes", routes),
                       ("dns", dns)):
        if value:
            result[key] = value
    return result


def _family(cidr: str) -> int:
    return ipaddress.ip_interface(cidr).version


def carried_by(result: dict[str, Any], version: str) -> dict[str, Any]:
    """The part of a 1.0.0 result that a `version` result can carry, as 1.0.0."""
    if version in V1:
        return result
    if version in V04:
        out = dict(result)
        if "interfaces" in result:
            out["interfaces"] = [
                {k: v for k, v in i.items() if k in ("name", "mac", "sandbox")}
                for i in result["interfaces"]
            ]
        return out
    firsts: dict[int, dict[str, Any]] = {}
    for ipc in result.get("ips", []):
        firsts.setdefault(_family(ipc["address"]), ipc)
    out = {"cniVersion": "1.0.0"}
    ips = [{k: v for k, v in firsts[f].items() if k != "interface"} for f in (4, 6) if f in firsts]
    routes = [r for f in (4, 6) if f in firsts
              for r in result.get("routes", []) if _family(r["dst"]) == f]
    for key, value in (("ips", ips), ("routes", routes), ("dns", result.get("dns"))):
        if value:
            out[key] = value
    return out


@given(results_100(), st.sampled_from(SUPPORTED_VERSIONS))
def test_round_trip_keeps_what_the_version_carries(result: dict[str, Any], version: str) -> None:
    if version in LEGACY and not result.get("ips"):
        with pytest.raises(ResultError, match="no IP address"):
            convert_result(result, version)
        return
    there = convert_result(result, version)
    assert there["cniVersion"] == version
    assert convert_result(there, "1.0.0") == carried_by(result, version)


@given(results_100(), st.sampled_from(SUPPORTED_VERSIONS))
def test_converted_results_parse_for_their_version(result: dict[str, Any], version: str) -> None:
    if version in LEGACY and not result.get("ips"):
        return
    converted = convert_result(result, version)
    if version_at_least(version, "0.3.0"):
        assert parse_result(converted, version) == converted
    assert parse_result(converted, "1.0.0") == converted  # its own cniVersion wins


@given(results_100())
def test_parse_accepts_generated_results_unchanged(result: dict[str, Any]) -> None:
    assert parse_result(result, "1.0.0") == result
    assert convert_result(result, "1.0.0") == result
