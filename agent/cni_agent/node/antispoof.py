"""Source filters on the host side of a bridge port: what a pod may claim to be.

A caller that is root in its own user namespace owns its pod's eth0 and can
give it any MAC and address. On a Linux bridge a gratuitous ARP, or a frame
from another pod's MAC, then moves the host's neighbour entry or the bridge's
fdb entry to its veth, and another pod's traffic goes to it. The filter must
sit where the pod cannot reach it: on the host side of its veth, as LXD's
`security.{mac,ipv4,ipv6}_filtering` and libvirt's `clean-traffic` do.

One nftables table of the agent's, in the `bridge` family (frames leaving a
pod's veth into the bridge, whether forwarded to another port or to the host,
all pass the bridge's prerouting hook):

    table bridge cni_agent {
        map ports { type ifname : verdict }          # host veth → jump port-<veth>
        chain prerouting { type filter hook prerouting priority filter
                           iifname vmap @ports }
        chain port-<veth> { … drop what the pod may not claim … }
    }

A port's chain drops, from that veth: another source MAC, VLAN-tagged frames
(their inner ARP and IP would pass unchecked), ARP whose sender MAC or IP is
not the pod's (0.0.0.0, an ARP probe, allowed), IPv4 from another source
(0.0.0.0 only to DHCP's server port, and only where `dhcp`), IPv6 from
another source than the pod's, link-local fe80::/10 and :: (ICMPv6 only: DAD
and MLD), neighbour advertisements for a target not its own or link-local, and
neighbour solicitations/advertisements whose link-layer option is not its
MAC; and what only the network's router or DHCP server sends: router
advertisements and redirects, DHCP (port 67) and DHCPv6 (547) replies.

Each port is added, checked and removed in one JSON batch through
libnftables (ctypes: the distributions' python3-nftables is the same thin
wrapper, but not on PyPI). Every rule carries a comment naming the filter's
digest, so a presence check can tell a complete chain from a flushed or
altered one without parsing rules back. Once a filter is in, what the pod
claimed before it was (`scrub`: the bridge's fdb, the host's neighbours) is
forgotten.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import ipaddress
import json
import logging
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TABLE = "cni_agent"
FAMILY = "bridge"
PORTS_MAP = "ports"
BASE_CHAIN = "prerouting"
CHAIN_PREFIX = "port-"
LIBRARY = "libnftables.so.1"
# nftables.h: enum nft_output_flags.
_NFT_CTX_OUTPUT_HANDLE = 1 << 3
_NFT_CTX_OUTPUT_JSON = 1 << 4
# A host-side interface name, as the kernel allows it (IFNAMSIZ, no '/', no blanks).
_IFNAME = re.compile(r"^[A-Za-z0-9_.@:+-]{1,15}$")
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


class FilterError(Exception):
    """nftables refused or failed a batch; the message is libnftables' own."""


class NftablesUnavailable(FilterError):
    """libnftables cannot be loaded or the kernel has no nf_tables: no filter can be installed."""


@dataclass(frozen=True)
class PortFilter:
    """What may leave one bridge port: the pod interface's MAC and addresses."""

    port: str  # the host-side veth
    mac: str
    ipv4: tuple[str, ...] = ()
    ipv6: tuple[str, ...] = ()
    dhcp: bool = False  # the network's IPAM is dhcp: DISCOVER/REQUEST from 0.0.0.0

    def __post_init__(self) -> None:
        if not _IFNAME.match(self.port):
            raise ValueError(f"{self.port!r} is not an interface name")
        if not _MAC.match(self.mac):
            raise ValueError(f"{self.mac!r} is not a lower-case MAC address")
        for a in self.ipv4:
            ipaddress.IPv4Address(a)
        for a in self.ipv6:
            ipaddress.IPv6Address(a)

    @classmethod
    def of(cls, port: str, mac: str, addresses: Iterable[str], dhcp: bool = False) -> PortFilter:
        """From a CNI result's view: addresses with or without a prefix length."""
        v4: set[str] = set()
        v6: set[str] = set()
        for text in addresses:
            ip = ipaddress.ip_interface(text).ip
            (v4 if ip.version == 4 else v6).add(str(ip))
        return cls(port, mac.lower(), tuple(sorted(v4)), tuple(sorted(v6)), dhcp)

    @property
    def chain(self) -> str:
        return CHAIN_PREFIX + self.port

    @property
    def digest(self) -> str:
        doc = [self.port, self.mac, list(self.ipv4), list(self.ipv6), self.dhcp]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


# --- the rules, as libnftables' JSON -------------------------------------------------


def _payload(protocol: str, field: str) -> dict[str, Any]:
    return {"payload": {"protocol": protocol, "field": field}}


def _raw(offset: int, length: int) -> dict[str, Any]:
    """Bits of the ICMPv6 header, past any extension headers (for what nft
    1.0.6 has no name for: an NA's target, ND options)."""
    return {"payload": {"base": "th", "offset": offset, "len": length}}


def _match(op: str, left: Any, right: Any) -> dict[str, Any]:
    return {"match": {"op": op, "left": left, "right": right}}


def _set(values: Sequence[Any]) -> Any:
    return values[0] if len(values) == 1 else {"set": list(values)}


def _hex(ip: str) -> str:
    return f"0x{int(ipaddress.IPv6Address(ip)):032x}"


# ICMPv6 neighbour discovery, in bits from the ICMPv6 header: the target
# address of an NA (after type, code, checksum and flags), and the first
# option (its type, then the link-layer address) of NS and NA.
_ND_TARGET = 64
_ND_OPTION_TYPE = 192
_ND_OPTION_MAC = 208
_LINK_LOCAL_TOP10 = "0x3fa"  # fe80::/10's first ten bits


def rules(f: PortFilter) -> list[list[dict[str, Any]]]:
    """The expressions of each rule of a port's chain (all drops; what is left passes)."""
    mac = f.mac
    ether_type = _payload("ether", "type")
    out: list[list[dict[str, Any]]] = [
        [_match("!=", _payload("ether", "saddr"), mac)],
        [_match("==", ether_type, {"set": ["8021q", "8021ad"]})],
        [_match("==", ether_type, "arp"), _match("!=", _payload("arp", "saddr ether"), mac)],
        [_match("==", ether_type, "arp"),
         _match("!=", _payload("arp", "saddr ip"), _set([*f.ipv4, "0.0.0.0"]))],
    ]
    v4_src = _payload("ip", "saddr")
    if f.dhcp:  # DHCP's DISCOVER and REQUEST come from 0.0.0.0 before there is a lease
        from_none = [_match("==", ether_type, "ip"), _match("==", v4_src, "0.0.0.0")]
        out.append([*from_none, _match("!=", {"meta": {"key": "l4proto"}}, "udp")])
        out.append([*from_none, _match("!=", _payload("udp", "dport"), 67)])
        out.append([_match("==", ether_type, "ip"),
                    _match("!=", v4_src, _set([*f.ipv4, "0.0.0.0"]))])
    else:
        out.append([_match("==", ether_type, "ip"), _match("!=", v4_src, _set(f.ipv4))]
                   if f.ipv4 else [_match("==", ether_type, "ip")])
    v6_src = _payload("ip6", "saddr")
    allowed6 = [*f.ipv6, {"prefix": {"addr": "fe80::", "len": 10}}, "::"]
    out += [
        [_match("==", ether_type, "ip6"), _match("!=", v6_src, _set(allowed6))],
        # :: is DAD's and MLD's source: ICMPv6 only.
        [_match("==", ether_type, "ip6"), _match("==", v6_src, "::"),
         _match("!=", {"meta": {"key": "l4proto"}}, "ipv6-icmp")],
    ]
    icmp_type = _payload("icmpv6", "type")
    na_target = [_match("!=", _raw(_ND_TARGET, 10), _LINK_LOCAL_TOP10)]
    if f.ipv6:
        na_target.append(_match("!=", _raw(_ND_TARGET, 128), _set([_hex(a) for a in f.ipv6])))
    mac_int = "0x" + mac.replace(":", "")
    out += [
        [_match("==", ether_type, "ip6"), _match("==", icmp_type, "nd-neighbor-advert"),
         *na_target],
        # Source link-layer option (type 1) of a solicitation, target (2) of an advertisement.
        [_match("==", ether_type, "ip6"), _match("==", icmp_type, "nd-neighbor-solicit"),
         _match("==", _raw(_ND_OPTION_TYPE, 8), 1),
         _match("!=", _raw(_ND_OPTION_MAC, 48), mac_int)],
        [_match("==", ether_type, "ip6"), _match("==", icmp_type, "nd-neighbor-advert"),
         _match("==", _raw(_ND_OPTION_TYPE, 8), 2),
         _match("!=", _raw(_ND_OPTION_MAC, 48), mac_int)],
    ]
    # Nor may it act as the network's router or DHCP server: router
    # advertisements and redirects, DHCP and DHCPv6 servers' replies.
    out += [
        [_match("==", ether_type, "ip6"),
         _match("==", icmp_type, {"set": ["nd-router-advert", "nd-redirect"]})],
        [_match("==", ether_type, "ip"), _match("==", _payload("udp", "sport"), 67)],
        [_match("==", ether_type, "ip6"), _match("==", _payload("udp", "sport"), 547)],
    ]
    return [[*r, {"drop": None}] for r in out]


def _comment(f: PortFilter, i: int) -> str:
    return f"cni-agent {f.digest} {i}"


def _base(table: str) -> list[dict[str, Any]]:
    """The table, its map and its hooked chain with its one rule: idempotent
    (the chain is flushed and its rule added again, in the same transaction)."""
    where = {"family": FAMILY, "table": table}
    return [
        {"add": {"table": {"family": FAMILY, "name": table}}},
        {"add": {"map": {**where, "name": PORTS_MAP, "type": "ifname", "map": "verdict"}}},
        {"add": {"chain": {**where, "name": BASE_CHAIN, "type": "filter", "hook": "prerouting",
                           "prio": -200, "policy": "accept"}}},
        {"flush": {"chain": {**where, "name": BASE_CHAIN}}},
        {"add": {"rule": {**where, "chain": BASE_CHAIN, "expr": [
            {"vmap": {"key": {"meta": {"key": "iifname"}}, "data": f"@{PORTS_MAP}"}}]}}},
    ]


def install_batch(f: PortFilter, table: str = TABLE) -> dict[str, Any]:
    """One transaction: the base, the port's chain (flushed: a repeat replaces
    it), its rules, and its entry in the map."""
    where = {"family": FAMILY, "table": table}
    cmds = [*_base(table),
            {"add": {"chain": {**where, "name": f.chain}}},
            {"flush": {"chain": {**where, "name": f.chain}}}]
    cmds += [{"add": {"rule": {**where, "chain": f.chain, "expr": expr,
                               "comment": _comment(f, i)}}}
             for i, expr in enumerate(rules(f))]
    cmds.append({"add": {"element": {**where, "name": PORTS_MAP,
                                     "elem": [[f.port, {"jump": {"target": f.chain}}]]}}})
    return {"nftables": cmds}


@dataclass(frozen=True)
class Installed:
    """What the agent's table holds now, as one listing shows it."""

    base: bool  # the hooked chain with its vmap rule
    ports: Mapping[str, str]  # veth → the chain its map entry jumps to
    comments: Mapping[str, frozenset[str]]  # chain → its rules' comments

    def complete(self, f: PortFilter) -> bool:
        """Whether `f` is in force exactly as it would be installed."""
        want = frozenset(_comment(f, i) for i in range(len(rules(f))))
        return self.base and self.ports.get(f.port) == f.chain and \
            self.comments.get(f.chain) == want

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> Installed:
        base = False
        ports: dict[str, str] = {}
        comments: dict[str, set[str]] = {}
        for item in doc.get("nftables", ()):
            if "map" in item and item["map"].get("name") == PORTS_MAP:
                for elem in item["map"].get("elem", ()):
                    key, verdict = elem
                    target = verdict.get("jump", {}).get("target") if isinstance(verdict, dict) \
                        else None
                    if isinstance(key, str) and isinstance(target, str):
                        ports[key] = target
            elif "chain" in item:
                comments.setdefault(item["chain"]["name"], set())
            elif "rule" in item:
                rule = item["rule"]
                if rule.get("chain") == BASE_CHAIN:
                    base = base or any("vmap" in e for e in rule.get("expr", ()))
                else:
                    comments.setdefault(rule["chain"], set()).add(str(rule.get("comment", "")))
        return cls(base, ports, {c: frozenset(s) for c, s in comments.items()})


EMPTY = Installed(False, {}, {})


def _trim() -> None:
    """glibc's malloc_trim(0): free pages of every arena back to the kernel."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        pass


class Nftables:
    """One libnftables context, JSON in and out. Blocking; not thread-safe:
    `Filters` calls it from one thread only."""

    def __init__(self, library: str = LIBRARY) -> None:
        try:
            lib = ctypes.CDLL(library, use_errno=True)
        except OSError as e:
            raise NftablesUnavailable(f"cannot load {library} ({e}); install libnftables1 "
                                      "(Debian) or nftables (Fedora)") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
        if not ctx:
            raise NftablesUnavailable("nft_ctx_new failed")
        self._lib = lib
        self._ctx: int | None = ctx
        lib.nft_ctx_output_set_flags(ctx, _NFT_CTX_OUTPUT_JSON | _NFT_CTX_OUTPUT_HANDLE)
        if lib.nft_ctx_buffer_output(ctx) or lib.nft_ctx_buffer_error(ctx):
            self.close()
            raise NftablesUnavailable("libnftables cannot buffer its output")

    def run(self, doc: Mapping[str, Any] | str) -> dict[str, Any]:
        """Run one batch (a JSON document, or nft's own syntax); its JSON output
        ({} when none). FilterError with libnftables' message when it fails."""
        if self._ctx is None:
            raise FilterError("libnftables context is closed")
        text = doc if isinstance(doc, str) else json.dumps(doc)
        rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
        out = self._lib.nft_ctx_get_output_buffer(self._ctx) or b""
        err = self._lib.nft_ctx_get_error_buffer(self._ctx) or b""
        if rc != 0:
            raise FilterError(err.decode(errors="replace").strip() or f"nftables failed ({rc})")
        return json.loads(out) if out.strip() else {}

    def close(self) -> None:
        if self._ctx is not None:
            self._lib.nft_ctx_free(self._ctx)
            self._ctx = None


_NTF_MASTER = 0x04  # an fdb entry of the bridge's, not the port device's own
_NUD_PERMANENT = 0x80


def scrub(f: PortFilter) -> list[str]:
    """Forget what the port's pod claimed before its filter was in force (its
    veth is on the bridge, and the pod can send, from the moment the bridge
    plugin attached it until the ADD chain is over): the bridge's fdb entries
    learned on the port for another MAC, and the host's neighbour entries on
    the bridge that give the pod's MAC for an address not its own. Without
    it, a quiet pod's traffic could go on reaching the impostor until those
    entries age out (minutes for an fdb entry). Blocking (netlink); what was
    removed, for the log and the tests."""
    from pyroute2 import IPRoute  # imported on first use, as netns.py does (0.15 s)

    removed: list[str] = []
    allowed = {*f.ipv4, *f.ipv6}
    with IPRoute() as ipr:
        links = ipr.link_lookup(ifname=f.port)
        if not links:
            return removed  # gone already: nothing of it to forget
        port = links[0]
        master = ipr.get_links(port)[0].get_attr("IFLA_MASTER")
        for n in ipr.get_neighbours(family=socket.AF_BRIDGE, ifindex=port):
            mac = str(n.get_attr("NDA_LLADDR") or "").lower()
            if mac and mac != f.mac and n.get_attr("NDA_MASTER") is not None and \
                    not n.get("state", 0) & _NUD_PERMANENT:
                ipr.neigh("del", family=socket.AF_BRIDGE, ifindex=port, lladdr=mac,
                          flags=_NTF_MASTER)
                removed.append(f"fdb {mac}")
        for n in ipr.get_neighbours(ifindex=master) if master else ():
            dst = str(n.get_attr("NDA_DST") or "")
            mac = str(n.get_attr("NDA_LLADDR") or "").lower()
            if mac == f.mac and dst and dst not in allowed:
                ipr.neigh("del", family=n.get("family"), dst=dst, ifindex=master)
                removed.append(f"neighbour {dst}")
    if removed:
        log.warning("%s: its pod claimed what is not its own before its filter was in force; "
                    "forgotten: %s", f.port, ", ".join(removed))
    return removed


def _missing(err: FilterError) -> bool:
    return "No such file or directory" in str(err)


class Filters:
    """The agent's port filters. Each call is one libnftables transaction.

    They run on one thread of their own, never on the event loop: a command
    may first fill libnftables' cache from the kernel, and that dump grows with
    the node's whole ruleset (kube-proxy's nftables mode alone makes
    thousands of rules); adding the hooked chain waits for the kernel's RCU
    grace period (measured here, a shared 2-core VM with 200 ports filtered:
    4 to 5 ms a port's batch, 8 to 18 ms at p95, up to 18 ms when the hooked
    chain is created, 80 to 150 ms to list the table for a presence check,
    100 ms for the first install, which imports pyroute2 to `scrub`: too long
    to stall every other call for). One thread, because a context must not
    be shared between threads and because one port's batches must apply in
    the order they were asked for.
    """

    def __init__(self, table: str = TABLE, library: str = LIBRARY) -> None:
        self.table = table  # tests give each their own
        self.library = library
        self._nft: Nftables | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cni-agent-nft")

    def _ctx(self) -> Nftables:
        if self._nft is None:
            self._nft = Nftables(self.library)
        return self._nft

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # --- on the nft thread ---------------------------------------------------------

    def _probe(self) -> None:
        """The library loads and the kernel answers for the bridge family (a listing: changes nothing)."""
        nft = self._ctx()
        nft.run({"nftables": [{"list": {"tables": {"family": FAMILY}}}]})

    def _list(self) -> Installed:
        try:
            doc = self._ctx().run({"nftables": [{"list": {"table": {"family": FAMILY,
                                                                       "name": self.table}}}]})
        except FilterError as e:
            if _missing(e):
                return EMPTY
            raise
        return Installed.parse(doc)

    def _install(self, f: PortFilter) -> None:
        self._ctx().run(install_batch(f, self.table))
        try:
            scrub(f)
        except Exception as e:  # the filter holds; what was learned before ages out
            log.warning("%s filtered, but what it claimed before could not be forgotten: %s",
                        f.port, e)

    def _remove(self, port: str) -> bool:
        """Whatever of `port`'s filter is there, gone in one transaction; whether any was.

        The whole filter first, in one batch; only when part of it is missing
        (nftables 1.0.6 has no `destroy`: a delete of what is not there fails
        the batch) the table is listed to delete what is left. A listing
        costs: 80 ms with 200 ports here, the batch 2 to 4 ms."""
        where = {"family": FAMILY, "table": self.table}
        chain = CHAIN_PREFIX + port
        element = {"delete": {"element": {**where, "name": PORTS_MAP, "elem": [port]}}}
        drop = [{"flush": {"chain": {**where, "name": chain}}},
                {"delete": {"chain": {**where, "name": chain}}}]
        try:
            self._ctx().run({"nftables": [element, *drop]})
            return True
        except FilterError as e:
            if not _missing(e):
                raise
        have = self._list()
        cmds = ([element] if port in have.ports else []) + (drop if chain in have.comments
                                                             else [])
        if cmds:
            self._ctx().run({"nftables": cmds})
        return bool(cmds)

    def _drop_table(self) -> None:
        try:
            self._ctx().run({"nftables": [{"delete": {"table": {"family": FAMILY,
                                                                  "name": self.table}}}]})
        except FilterError as e:
            if not _missing(e):
                raise

    # --- the loop's side -------------------------------------------------------------

    async def probe(self) -> None:
        """NftablesUnavailable (with why) unless filters can be installed here."""
        try:
            await self._call(self._probe)
        except NftablesUnavailable:
            raise
        except FilterError as e:
            raise NftablesUnavailable(f"nftables does not answer: {e}") from None

    async def install(self, f: PortFilter) -> None:
        """Install (or replace) `f`, atomically."""
        await self._call(self._install, f)

    async def remove(self, port: str) -> bool:
        """Remove the port's filter; whether there was one (none: success too)."""
        return bool(await self._call(self._remove, port))

    async def installed(self) -> Installed:
        """One listing of the table: what a presence check compares with."""
        result: Installed = await self._call(self._list)
        return result

    async def idle(self) -> None:
        """Nothing is filtered now: the context goes, with the cache it built from
        the kernel (some MiB, more with a big ruleset), and what its thread's
        malloc arena keeps is given back; the next call makes a new one."""
        if self._nft is not None:  # set on the nft thread; None: nothing to free
            await self._call(self._idle)

    def _idle(self) -> None:
        if self._nft is not None:
            self._nft.close()
            self._nft = None
            _trim()

    async def drop_table(self) -> None:
        """The whole table gone (tests; an agent never drops its members' filters)."""
        await self._call(self._drop_table)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._nft is not None:
            self._nft.close()
            self._nft = None
