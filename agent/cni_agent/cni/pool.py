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

A network's capacity (`capacity_plan`, then `read_capacity`: what
`NetworkCapacity`, `cni-agent networks` and the `cni_agent_ipam_addresses`
metric say) adds what is in use: host-local keeps one file per leased
address, named by the address, in its `dataDir` (default
`/var/lib/cni/networks`) under the network's name; its `lock` and
`last_reserved_ip.N` files are no leases. An address counts as used in the
range it falls in (the gateway never does); a file of no current range (a
lease made under an older config) counts nowhere. Read without host-local's
lock (a lease appears as one file, created at once), so a reading is a
moment's: an ADD under way may or may not be in it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
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
    return [sum(r.size for r in rs) for rs in ranges_of(ipam)]


def ranges_of(ipam: Mapping[str, Any]) -> list[list[Range]]:
    """The range sets of one host-local `ipam` section, each a list of its
    ranges; UnknownPool where host-local would refuse it."""
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
    return [[Range.parse(r) for r in rs] for rs in sets]


def range_size(raw: Any) -> int:
    """The addresses one host-local range gives; UnknownPool if host-local would refuse it."""
    return Range.parse(raw).size


@dataclass(frozen=True)
class Range:
    """One host-local range: `subnet`, from `start` to `end` (inclusive), less
    the `gateway` where it falls inside; addresses as integers."""

    subnet: ipaddress.IPv4Network | ipaddress.IPv6Network
    start: int
    end: int
    gateway: int

    @classmethod
    def parse(cls, raw: Any) -> Range:
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
        return cls(subnet, start, end, gateway)

    @property
    def size(self) -> int:
        # host-local's iterator skips the gateway wherever it falls in the range.
        return self.end - self.start + 1 - (1 if self.contains(self.gateway) else 0)

    def contains(self, addr: int) -> bool:
        return self.start <= addr <= self.end

    def _ip(self, addr: int) -> str:
        return str(ipaddress.ip_address(addr) if self.subnet.version == 4
                   else ipaddress.IPv6Address(addr))

    @property
    def label(self) -> str:
        """The range as one short string: its subnet when it spans all of it
        (host-local's defaults), else its first and last address."""
        first = int(self.subnet.network_address) + 1
        last = int(self.subnet.broadcast_address) - (1 if self.subnet.version == 4 else 0)
        if (self.start, self.end) == (first, last):
            return str(self.subnet)
        return f"{self._ip(self.start)}-{self._ip(self.end)}"

    def to_json(self) -> dict[str, Any]:
        return {"range": self.label, "subnet": str(self.subnet),
                "range_start": self._ip(self.start), "range_end": self._ip(self.end),
                "gateway": self._ip(self.gateway)}


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


DEFAULT_DATA_DIR = "/var/lib/cni/networks"
STATIC = "static"
# Reference plugins that give no address of their own without an `ipam`
# section: a chain of only these, and no IPAM, has no pool. Any other plugin
# without one (flannel, cilium-cni, a vendor's) may allocate by itself: unknown.
NO_ADDRESS_PLUGINS = frozenset({
    "bandwidth", "bridge", "dummy", "firewall", "host-device", "ipvlan", "loopback", "macvlan",
    "portmap", "ptp", "sbr", "tap", "tuning", "vlan", "vrf"})


class CapacityState(StrEnum):
    KNOWN = "known"  # host-local: its ranges and data dir say it
    NONE = "none"  # no pool: static addresses, or no IPAM at all
    UNKNOWN = "unknown"  # another IPAM (dhcp, whereabouts, a vendor's), or ranges per call


@dataclass(frozen=True)
class HostLocalPool:
    """One host-local `ipam` section: where it keeps its leases, and its range sets."""

    data_dir: str
    range_sets: tuple[tuple[Range, ...], ...]


@dataclass(frozen=True)
class CapacityPlan:
    """What a network's capacity is made of, from its config alone (no disk read)."""

    network: str
    state: CapacityState
    ipam: tuple[str, ...]
    reason: str = ""
    pools: tuple[HostLocalPool, ...] = ()

    def unknown(self, reason: str) -> dict[str, Any]:
        return {"network": self.network, "capacity": str(CapacityState.UNKNOWN),
                "ipam": list(self.ipam), "reason": reason}


def capacity_plan(net: NetworkConfigList) -> CapacityPlan:
    """Whether `net`'s capacity can be known, and where to read it."""
    types: list[str] = []
    pools: list[HostLocalPool] = []
    unknown = ""
    bare: list[str] = []  # plugins without an ipam section
    for plugin in net.plugins:
        ipam = plugin.raw.get("ipam")
        if not isinstance(ipam, Mapping) or not ipam:
            bare.append(plugin.type)
            continue
        kind = ipam.get("type")
        kind = kind if isinstance(kind, str) and kind else "?"
        types.append(kind)
        if kind == STATIC:
            continue
        if kind != HOST_LOCAL:
            unknown = unknown or (f"IPAM {kind} keeps its addresses where the agent does not "
                                  "read them")
            continue
        if "ipRanges" in plugin.capabilities:
            unknown = unknown or ("host-local takes the ipRanges capability: its ranges come "
                                  "with each call")
            continue
        data_dir = ipam.get("dataDir") or DEFAULT_DATA_DIR
        try:
            if not isinstance(data_dir, str):
                raise UnknownPool("dataDir is not a string")
            sets = ranges_of(ipam)
        except UnknownPool as e:
            unknown = unknown or f"host-local would refuse its config: {e}"
            continue
        pools.append(HostLocalPool(os.path.join(data_dir, net.name),
                                   tuple(tuple(rs) for rs in sets)))
    ipams = tuple(types)
    if unknown:
        return CapacityPlan(net.name, CapacityState.UNKNOWN, ipams, unknown)
    if pools:
        return CapacityPlan(net.name, CapacityState.KNOWN, ipams, pools=tuple(pools))
    if not types and any(t not in NO_ADDRESS_PLUGINS for t in bare):
        first = next(t for t in bare if t not in NO_ADDRESS_PLUGINS)
        return CapacityPlan(net.name, CapacityState.UNKNOWN, ipams,
                            f"plugin {first} has no ipam section: it may allocate addresses "
                            "itself")
    return CapacityPlan(net.name, CapacityState.NONE, ipams,
                        "static IPAM: the config gives the addresses, there is no pool"
                        if types else "no IPAM: the network gives no addresses")


def read_capacity(plan: CapacityPlan) -> dict[str, Any]:
    """The capacity document of `plan`: reads host-local's data dirs (blocking:
    call it off the event loop). Its `size`, `used` and `free` are those of the
    range set with the fewest free addresses: each attachment takes one of
    every range set, so that one says how many more the network can take."""
    if plan.state is not CapacityState.KNOWN:
        return {"network": plan.network, "capacity": str(plan.state), "ipam": list(plan.ipam),
                "reason": plan.reason}
    sets: list[dict[str, Any]] = []
    for pool in plan.pools:
        try:
            leased = leases(pool.data_dir)
        except OSError as e:
            return plan.unknown(f"cannot read host-local's data dir {pool.data_dir}: "
                                f"{e.strerror or e}")
        for rs in pool.range_sets:
            ranges = []
            for r in rs:
                used = sum(1 for a in leased.get(r.subnet.version, ())
                           if r.contains(a) and a != r.gateway)
                ranges.append({**r.to_json(), "size": r.size, "used": used,
                               "free": max(r.size - used, 0)})
            size = sum(x["size"] for x in ranges)
            used = sum(x["used"] for x in ranges)
            sets.append({"data_dir": pool.data_dir, "size": size, "used": used,
                         "free": max(size - used, 0), "ranges": ranges})
    tightest = min(sets, key=lambda s: s["free"])
    return {"network": plan.network, "capacity": str(CapacityState.KNOWN),
            "ipam": list(plan.ipam), "size": tightest["size"], "used": tightest["used"],
            "free": tightest["free"], "range_sets": sets}


def leases(data_dir: str) -> dict[int, list[int]]:
    """The addresses host-local has leased in `data_dir`, by IP version (its
    files named by an address; `lock`, `last_reserved_ip.N` and anything else
    are no leases). A data dir host-local has not made yet holds none."""
    found: dict[int, list[int]] = {4: [], 6: []}
    try:
        with os.scandir(data_dir) as entries:
            for entry in entries:
                name = entry.name
                if not (name[:1].isdigit() or ":" in name):
                    continue
                try:
                    addr = ipaddress.ip_address(name)
                except ValueError:
                    continue
                found[addr.version].append(int(addr))
    except FileNotFoundError:
        pass
    return found


def pool_full(doc: Mapping[str, Any]) -> str:
    """A capacity document's words when a range set has no free address, else ""."""
    if doc.get("capacity") != CapacityState.KNOWN:
        return ""
    for rs in doc.get("range_sets", ()):
        if rs["free"] == 0:
            where = ", ".join(r["range"] for r in rs["ranges"])
            return (f"network {doc['network']}'s address pool is full ({rs['used']} of "
                    f"{rs['size']} addresses of {where} in use; `cni-agent networks` shows it)")
    return ""
