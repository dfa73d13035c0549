"""A network's address pool as host-local sizes it (cni/pool.py), as tables.

tests/integration/test_reference_plugins.py leases the real host-local's
pools until it refuses, and compares with these numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.config import parse_list
from cni_agent.cni.pool import (
    CapacityState,
    Pool,
    UnknownPool,
    capacity_plan,
    pool_full,
    pool_of,
    range_size,
    read_capacity,
)


@pytest.mark.parametrize(("rng", "size"), [
    ({"subnet": "10.1.0.0/24"}, 253),  # .1 (gateway) .. .254, the gateway skipped
    ({"subnet": "10.1.0.0/28", "rangeStart": "10.1.0.2", "rangeEnd": "10.1.0.13"}, 12),
    ({"subnet": "10.1.0.0/28", "rangeStart": "10.1.0.1", "rangeEnd": "10.1.0.4"}, 3),  # gateway .1
    ({"subnet": "10.1.0.0/28", "gateway": "10.1.0.14"}, 13),  # .1 .. .14 less the gateway
    ({"subnet": "10.1.0.0/28", "gateway": "10.1.0.9", "rangeStart": "10.1.0.2",
      "rangeEnd": "10.1.0.5"}, 4),  # a gateway outside the range takes nothing from it
    ({"subnet": "10.1.0.0/30"}, 1),  # .1 is the gateway, .2 the one address
    ({"subnet": "fd00::/120"}, 254),  # IPv6: ::1 .. ::ff (no broadcast), less ::1
    ({"subnet": "fd00::/64", "rangeStart": "fd00::10", "rangeEnd": "fd00::1f"}, 16),
])
def test_range_size(rng: dict[str, str], size: int) -> None:
    assert range_size(rng) == size


@pytest.mark.parametrize("rng", [
    {"subnet": "10.1.0.0/31"},  # too small to allocate from
    {"subnet": "10.1.0.5/24"},  # host bits set
    {"subnet": "10.1.0.0/24", "rangeStart": "10.2.0.1"},  # outside
    {"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.9", "rangeEnd": "10.1.0.3"},
    {"subnet": "10.1.0.0/24", "rangeEnd": 7},
    {"subnet": 17},
    {},
    "10.1.0.0/24",
])
def test_a_range_host_local_would_refuse_has_no_size(rng: Any) -> None:
    with pytest.raises(UnknownPool):
        range_size(rng)


def network(*plugins: dict[str, Any]) -> Any:
    return parse_list(json.dumps({"cniVersion": "1.0.0", "name": "n",
                                  "plugins": list(plugins)}).encode())


def bridge(ipam: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "bridge", "bridge": "br0", "ipam": ipam, **extra}


@pytest.mark.parametrize(("plugins", "sets"), [
    # old style: one range set
    ([bridge({"type": "host-local", "subnet": "10.1.0.0/28", "rangeStart": "10.1.0.2",
              "rangeEnd": "10.1.0.13"}), {"type": "portmap"}], (12,)),
    # ranges: a range set is the sum of its ranges; one address from each set
    ([bridge({"type": "host-local", "ranges": [
        [{"subnet": "10.1.0.0/29"}, {"subnet": "10.2.0.0/29"}],
        [{"subnet": "fd00::/124"}]]})], (10, 14)),
    # both: the old-style range first
    ([bridge({"type": "host-local", "subnet": "10.1.0.0/29",
              "ranges": [[{"subnet": "10.3.0.0/30"}]]})], (5, 1)),
])
def test_pool_of_a_network(plugins: list[dict[str, Any]], sets: tuple[int, ...]) -> None:
    assert pool_of(network(*plugins)) == Pool(sets)


@pytest.mark.parametrize("plugins", [
    [bridge({"type": "dhcp"})],  # another IPAM: the config does not say
    [{"type": "loopback"}],  # no IPAM at all
    [bridge({"type": "host-local", "subnet": "10.1.0.0/24"},
            capabilities={"ipRanges": True})],  # the ranges come with each call
    [bridge({"type": "host-local", "subnet": "10.1.0.0/32"})],  # host-local would refuse it
    [bridge({"type": "host-local", "ranges": [[]]})],
])
def test_a_pool_the_config_does_not_give_is_unknown(plugins: list[dict[str, Any]]) -> None:
    assert pool_of(network(*plugins)) is None


@pytest.mark.parametrize(("sets", "share", "most"), [
    ((12,), 0.5, 6), ((12,), 0.0, 0), ((12,), 1.0, 12), ((13,), 0.5, 6),
    ((100,), 0.29, 29),  # the decimal written, not its binary neighbour (28.999…)
    ((10, 14), 0.5, 5),  # the smallest range set bounds every attachment
])
def test_a_share_of_a_pool(sets: tuple[int, ...], share: float, most: int) -> None:
    assert Pool(sets).share(share) == most


# --- capacity: what is in use, as host-local's data dir says ----------------------------


def test_capacity_counts_host_local_leases_range_by_range(tmp_path: Path) -> None:
    net = network(bridge({"type": "host-local", "dataDir": str(tmp_path), "ranges": [
        [{"subnet": "10.1.0.0/29", "rangeStart": "10.1.0.2", "rangeEnd": "10.1.0.3"},
         {"subnet": "10.2.0.0/29"}],
        [{"subnet": "fd00::/125", "gateway": "fd00::7"}]]}))
    plan = capacity_plan(net)
    assert plan.state is CapacityState.KNOWN and plan.ipam == ("host-local",)
    leases_dir = tmp_path / "n"
    leases_dir.mkdir()
    for name in ("10.1.0.2", "10.2.0.3", "10.2.0.1",  # .1: the /29's gateway, never a lease
                 "fd00::2", "fd00::3",
                 "lock", "last_reserved_ip.0", "last_reserved_ip.1",  # no leases
                 "10.9.0.5", "10.1.0.4"):  # of no current range (an older config's)
        (leases_dir / name).write_text("container\r\neth0")
    doc = read_capacity(plan)
    first, second = doc["range_sets"]
    assert [(r["range"], r["size"], r["used"], r["free"]) for r in first["ranges"]] == [
        ("10.1.0.2-10.1.0.3", 2, 1, 1), ("10.2.0.0/29", 5, 1, 4)]
    assert [(r["range"], r["gateway"], r["size"], r["used"]) for r in second["ranges"]] == [
        ("fd00::/125", "fd00::7", 6, 2)]  # ::1 .. ::7, the gateway ::7 skipped
    assert (first["size"], first["used"], first["free"]) == (7, 2, 5)
    assert (second["size"], second["used"], second["free"]) == (6, 2, 4)
    # The network's figures are its range set with the fewest free addresses.
    assert (doc["size"], doc["used"], doc["free"]) == (6, 2, 4)
    assert first["data_dir"] == str(leases_dir)
    assert pool_full(doc) == ""


def test_a_data_dir_host_local_has_not_made_yet_holds_no_lease(tmp_path: Path) -> None:
    net = network(bridge({"type": "host-local", "subnet": "10.1.0.0/29",
                          "dataDir": str(tmp_path / "none")}))
    doc = read_capacity(capacity_plan(net))
    assert (doc["capacity"], doc["size"], doc["used"], doc["free"]) == ("known", 5, 0, 5)


def test_the_default_data_dir_is_host_locals() -> None:
    [pool] = capacity_plan(network(bridge({"type": "host-local", "subnet": "10.1.0.0/29"}))).pools
    assert pool.data_dir == "/var/lib/cni/networks/n"


def test_a_full_range_set_is_a_full_pool(tmp_path: Path) -> None:
    net = network(bridge({"type": "host-local", "subnet": "10.1.0.0/30",
                          "dataDir": str(tmp_path)}))
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "10.1.0.2").write_text("c\r\neth0")
    doc = read_capacity(capacity_plan(net))
    assert (doc["used"], doc["free"]) == (1, 0)
    assert pool_full(doc) == ("network n's address pool is full (1 of 1 addresses of "
                              "10.1.0.0/30 in use; `cni-agent networks` shows it)")


def test_an_unreadable_data_dir_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "n").write_text("a file where the directory should be")
    doc = read_capacity(capacity_plan(network(bridge(
        {"type": "host-local", "subnet": "10.1.0.0/29", "dataDir": str(tmp_path)}))))
    assert doc["capacity"] == "unknown" and "cannot read host-local's data dir" in doc["reason"]
    assert pool_full(doc) == ""


@pytest.mark.parametrize(("plugins", "state", "ipam", "why"), [
    ([bridge({"type": "static", "addresses": [{"address": "10.1.0.2/24"}]})], "none",
     ["static"], "static IPAM"),
    ([{"type": "loopback"}], "none", [], "no IPAM"),
    ([bridge({"type": "dhcp"})], "unknown", ["dhcp"], "IPAM dhcp keeps"),
    ([bridge({"type": "whereabouts", "range": "10.1.0.0/24"})], "unknown", ["whereabouts"],
     "IPAM whereabouts keeps"),
    ([{"type": "cilium-cni"}], "unknown", [], "plugin cilium-cni has no ipam section"),
    ([bridge({"type": "host-local", "subnet": "10.1.0.0/24"},
             capabilities={"ipRanges": True})], "unknown", ["host-local"], "ipRanges"),
    ([bridge({"type": "host-local", "subnet": "10.1.0.0/32"})], "unknown", ["host-local"],
     "host-local would refuse"),
    # A known pool and another IPAM in one chain: not a guess either.
    ([bridge({"type": "host-local", "subnet": "10.1.0.0/24"}),
      {"type": "macvlan", "master": "eth0", "ipam": {"type": "dhcp"}}], "unknown",
     ["host-local", "dhcp"], "IPAM dhcp"),
])
def test_capacity_without_a_host_local_pool(plugins: list[dict[str, Any]], state: str,
                                            ipam: list[str], why: str) -> None:
    doc = read_capacity(capacity_plan(network(*plugins)))
    assert (doc["capacity"], doc["ipam"]) == (state, ipam)
    assert why in doc["reason"]
    assert not {"size", "used", "free", "range_sets"} & set(doc)
