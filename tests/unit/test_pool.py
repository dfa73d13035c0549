"""A network's address pool as host-local sizes it (cni/pool.py), as tables.

tests/integration/test_reference_plugins.py leases the real host-local's
pools until it refuses, and compares with these numbers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cni_agent.cni.config import parse_list
from cni_agent.cni.pool import Pool, UnknownPool, pool_of, range_size


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
