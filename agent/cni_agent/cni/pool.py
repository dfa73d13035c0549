"""How many addresses a network's IPAM can give, where its config says so.

Only host-local (the reference IPAM) is read, as it reads itself
(`plugins/ipam/host-local/backend/allocator`): every attachment takes one
address from each of its range sets; a range set is the sum of its ranges;
a range is `subnet` from `rangeStart` (default: the subnet's first address
after the network's) to `rangeEnd` (default: its last, the IPv4 broadcast
excluded), less the `gateway` (default: the first address) where it falls
inside. The old-style `subnet`/`rangeStart`/`rangeEnd`/`gateway` at the top of
`ipam` is a range set of its own, before `ranges`.

Unknown (None) wherever the config alone does not tell: no host-local `ipam`
in the chain, or a host-local one whose plugin takes the `ipRanges`
capability (the ranges then come with each call), or a config host-local
itself would refuse. The policy treats unknown as "no pool limit".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from cni_agent.cni.config import NetworkConfigList

HOST_LOCAL = "host-local"

class UnknownPool(ValueError):
    """The config does not say how large the pool is (or host-local would refuse it)."""


@dataclass(frozen=True)
class Pool:
    """The addresses each range set of a network can give, in order."""

    range_sets: tuple[int, ...]

    @property
    def size(self) -> int:
        """Attachments the network can hold: each takes one address of every range set."""
        return min(self.range_sets)

    def share(self, fraction: float) -> int:
        """Attachments that hold at most `fraction` of every range set's
        addresses (rounded down; `fraction` read as the decimal it was written as)."""
        exact = Fraction(fraction).limit_denominator(10**6)
        return min(int(exact * n) for n in self.range_sets)


def pool_of(net: NetworkConfigList) -> Pool | None:
    """The pool of every host-local `ipam` in the chain, None when unknown."""
    sets: list[int] = []
    for plugin in net.plugins:
        ipam = plugin.raw.get("ipam")
        if not isinstance(ipam, Mapping) or ipam.get("type") != HOST_LOCAL:
            continue
        if "ipRanges" in plugin.capabilities:
            return None
        try:
            sets += range_sets(ipam)
        except UnknownPool:
            return None
    return Pool(tuple(sets)) if sets else None


def range_sets(ipam: Mapping[str, Any]) -> list[int]:
    """The size of each range set of one host-local `ipam` section;
    UnknownPool where host-local would refuse it."""
    sets: list[list[Any]] = []
    if ipam.get("subnet") is not None:
        sets.append([{k: ipam[k] for k in ("subnet", "rangeStart", "rangeEnd", "gateway")
                      if k in ipam}])
    ranges = ipam.get("ranges", [])
    if not isinstance(ranges, list):
        raise UnknownPool("ranges is not a list")
    for rs in ranges:
        if not isinstance(rs, list) or not rs:
            raise UnknownPool("a range set is not a non-empty list")
        sets.append(rs)
    if not sets:
        raise UnknownPool("no subnet and no ranges")
    return [sum(range_size(r) for r in rs) for rs in sets]


def range_size(raw: Any) -> int:
    """The addresses one host-local range gives; UnknownPool if host-local would refuse it."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("subnet"), str):
        raise UnknownPool("a range is not an object with a subnet")
    try:
        subnet = ipaddress.ip_network(raw["subnet"])  # host bits set: refused, as host-local does
    except ValueError as e:
        raise UnknownPool(f"subnet: {e}") from None
    if subnet.prefixlen > subnet.max_prefixlen - 2:
        raise UnknownPool(f"{subnet} is too small to allocate from")
    first = int(subnet.network_address) + 1
    last = int(subnet.broadcast_address) - (1 if subnet.version == 4 else 0)
    start = _address(raw, "rangeStart", subnet, first)
    end = _address(raw, "rangeEnd", subnet, last)
    gateway = _address(raw, "gateway", None, first)
    if end < start:
        raise UnknownPool("rangeEnd is before rangeStart")
    # host-local's iterator skips the gateway wherever it falls in the range.
    return end - start + 1 - (1 if start <= gateway <= end else 0)


def _address(raw: Mapping[str, Any], key: str,
             subnet: ipaddress.IPv4Network | ipaddress.IPv6Network | None, default: int) -> int:
    """`raw[key]` as an integer (`default` when absent), inside `subnet` unless None."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise UnknownPool(f"{key} is not a string")
    try:
        addr = ipaddress.ip_address(value)
    except ValueError as e:
        raise UnknownPool(f"{key}: {e}") from None
    if subnet is not None and addr not in subnet:
        raise UnknownPool(f"{key} {addr} is outside {subnet}")
    return int(addr)
