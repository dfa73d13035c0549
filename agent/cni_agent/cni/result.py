"""CNI results: validation and conversion between spec versions, as libcni does them.

Results stay plain JSON dicts because the cache stores them in libcni's format.
There are three shapes ("families"):

- legacy, 0.1.0/0.2.0: ``ip4``/``ip6`` objects, each with its own routes;
- 0.3.0/0.3.1/0.4.0: ``interfaces``, ``ips`` (with ``version``), ``routes``;
- 1.0.0/1.1.0: as 0.4.0, ``ips`` without ``version``; interfaces may carry
  ``mtu``, ``socketPath`` and ``pciID``.

Conversion between families steps through the 0.4 shape, like libcni's
converters. Within a family only ``cniVersion`` changes and unknown keys
survive; across families entries are rebuilt from the fields libcni knows.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
from collections.abc import Callable, Mapping
from typing import Any

from cni_agent.cni.errors import ResultError

SUPPORTED_VERSIONS = ("0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

_LEGACY, _V04, _V1 = 0, 1, 2
_FAMILY = {
    "0.1.0": _LEGACY, "0.2.0": _LEGACY,
    "0.3.0": _V04, "0.3.1": _V04, "0.4.0": _V04,
    "1.0.0": _V1, "1.1.0": _V1,
}
_LEGACY_KEYS = frozenset({"ip4", "ip6"})
_RICH_KEYS = frozenset({"interfaces", "ips", "routes"})
_DNS_KEYS = ("nameservers", "domain", "search", "options")
# Route attributes added in 1.1.0; libcni shares one route type for 0.3+ results,
# so they survive 1.x -> 0.4 -> 1.x and are checked wherever they appear.
_ROUTE_INTS = ("mtu", "advmss", "priority", "table", "scope")


# Cached: a handful of versions, compared several times a call. A bad one
# raises, and exceptions are not cached.
@functools.lru_cache(maxsize=64)
def version_key(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in version.split("."))
    except ValueError:
        raise ResultError(f"invalid version {version!r}") from None


def version_at_least(version: str, minimum: str) -> bool:
    return version_key(version) >= version_key(minimum)


def _family(version: Any, what: str) -> int:
    if not isinstance(version, str):
        raise ResultError(f"{what} must be a string, not {_kind(version)}")
    family = _FAMILY.get(version)
    if family is None:
        raise ResultError(
            f"unsupported {what} {version!r} (supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    return family


# --- field validation ---------------------------------------------------------


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ResultError(f"{where}: expected an object, got {_kind(value)}")
    # Go decodes null as the zero value, so a null field is an absent one.
    return {k: v for k, v in value.items() if v is not None}


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ResultError(f"{where}: expected a list, got {_kind(value)}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ResultError(f"{where}: expected a string, got {_kind(value)}")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ResultError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


# The address parsers are cached: a pod's addresses are checked at its ADD, its
# answer, its CHECK and its DEL, and a node's gateways and routes on every
# result; ipaddress costs ~10 us a parse. Bounded: a plugin may print anything.
_CACHED = 4096


@functools.lru_cache(maxsize=_CACHED)
def _canonical_cidr(text: str) -> str | None:
    """Canonical "ip/prefix" (host bits kept: an address, not a network), None if not one."""
    addr, slash, prefix = text.partition("/")
    # ipaddress would also take a bare IP, a netmask or a zone; Go's ParseCIDR does not.
    if slash and prefix.isascii() and prefix.isdigit() and "%" not in addr:
        try:
            return str(ipaddress.ip_interface(text))
        except ValueError:
            pass
    return None


@functools.lru_cache(maxsize=_CACHED)
def _canonical_ip(text: str) -> str | None:
    if "%" not in text:
        try:
            return str(ipaddress.ip_address(text))
        except ValueError:
            pass
    return None


def _address(value: Any, where: str, canonical: Callable[[str], str | None], what: str) -> str:
    text = _str(value, where)
    out = canonical(text)
    if out is None:
        raise ResultError(f"{where}: {text!r} is not {what}")
    return out


def _cidr(value: Any, where: str) -> str:
    return _address(value, where, _canonical_cidr, "a CIDR address (ip/prefix)")


def _ip(value: Any, where: str) -> str:
    return _address(value, where, _canonical_ip, "an IP address")


@functools.lru_cache(maxsize=_CACHED)
def _ip_family(cidr: str) -> str:
    """Return "4" or "6" by libcni's rule: an IPv4-mapped IPv6 address counts as IPv4."""
    ip = ipaddress.ip_interface(cidr).ip
    mapped = isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None
    return "4" if ip.version == 4 or mapped else "6"


def _optional_ip(obj: dict[str, Any], key: str, where: str) -> None:
    if obj.get(key) == "":  # Go reads "" as no IP
        del obj[key]
    elif key in obj:
        obj[key] = _ip(obj[key], f"{where}.{key}")


def _put(obj: dict[str, Any], key: str, value: Any) -> None:
    """Set key, or drop it when empty (libcni's omitempty)."""
    if value:
        obj[key] = value
    else:
        obj.pop(key, None)


def _pick(obj: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: obj[k] for k in keys if k in obj}


# --- parsing ------------------------------------------------------------------


def _parse_dns(value: Any) -> dict[str, Any]:
    dns = _obj(value, "dns")
    for key in ("nameservers", "search", "options"):
        if key in dns:
            items = _list(dns[key], f"dns.{key}")
            _put(dns, key, [_str(x, f"dns.{key}[{i}]") for i, x in enumerate(items)])
    if "domain" in dns:
        _put(dns, "domain", _str(dns["domain"], "dns.domain"))
    return dns


def _parse_route(value: Any, where: str) -> dict[str, Any]:
    route = _obj(value, where)
    if "dst" not in route:
        raise ResultError(f"{where}: missing 'dst'")
    route["dst"] = _cidr(route["dst"], f"{where}.dst")
    _optional_ip(route, "gw", where)
    for key in _ROUTE_INTS:
        if key in route:
            _int(route[key], f"{where}.{key}")
    return route


def _parse_routes(value: Any, where: str) -> list[dict[str, Any]]:
    return [_parse_route(r, f"{where}[{i}]") for i, r in enumerate(_list(value, where))]


def _parse_legacy_ip(value: Any, key: str, family: str) -> dict[str, Any]:
    ipc = _obj(value, key)
    if "ip" not in ipc:
        raise ResultError(f"{key}: missing 'ip'")
    ipc["ip"] = _cidr(ipc["ip"], f"{key}.ip")
    if _ip_family(ipc["ip"]) != family:
        raise ResultError(f"{key}.ip: {ipc['ip']!r} is not an IPv{family} address")
    _optional_ip(ipc, "gateway", key)
    if "routes" in ipc:
        _put(ipc, "routes", _parse_routes(ipc["routes"], f"{key}.routes"))
    return ipc


def _parse_interface(value: Any, where: str, family: int) -> dict[str, Any]:
    iface = _obj(value, where)
    if not isinstance(iface.get("name"), str) or not iface["name"]:
        raise ResultError(f"{where}.name: expected a non-empty string")
    for key in ("mac", "sandbox"):
        if key in iface:
            _str(iface[key], f"{where}.{key}")
    if family == _V1:
        if "mtu" in iface:
            _int(iface["mtu"], f"{where}.mtu")
        for key in ("socketPath", "pciID"):
            if key in iface:
                _str(iface[key], f"{where}.{key}")
    return iface


def _parse_ipconfig(value: Any, where: str, family: int, n_ifaces: int) -> dict[str, Any]:
    ipc = _obj(value, where)
    if "address" not in ipc:
        raise ResultError(f"{where}: missing 'address'")
    ipc["address"] = _cidr(ipc["address"], f"{where}.address")
    _optional_ip(ipc, "gateway", where)
    if "interface" in ipc:
        index = ipc["interface"]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_ifaces:
            raise ResultError(
                f"{where}.interface: index {index!r} out of range "
                f"(the result has {n_ifaces} interfaces)"
            )
    if family == _V04:
        version, actual = ipc.get("version"), _ip_family(ipc["address"])
        if version not in ("4", "6"):
            raise ResultError(f'{where}.version: expected "4" or "6", got {version!r}')
        if version != actual:
            raise ResultError(
                f"{where}.version: {version!r} but {ipc['address']!r} is IPv{actual}"
            )
    else:
        ipc.pop("version", None)  # removed in 1.0.0; a stale one must not travel on
    return ipc


def parse_result(data: Any, config_version: str, *, owned: bool = False) -> dict[str, Any]:
    """Validate a plugin's result; a result without cniVersion takes the config's.

    Returns a normalised deep copy: nulls and empty collections dropped,
    addresses in canonical form, unknown keys kept. `owned`: `data` is the
    caller's to give away (just decoded, or read for one use), so it is not
    copied first: the result may share unknown keys' values with it (`data`
    itself is never changed).
    """
    if not isinstance(data, dict):
        raise ResultError(f"result: expected a JSON object, got {_kind(data)}")
    version = data.get("cniVersion")
    if version is None or version == "":  # libcni fills in the config's version
        version = config_version
    family = _family(version, "result version")
    # cniVersion first, for readable JSON; the second line overrides a "" from data
    result = {"cniVersion": version, **_obj(data if owned else copy.deepcopy(data), "result")}
    result["cniVersion"] = version
    foreign = (_RICH_KEYS if family == _LEGACY else _LEGACY_KEYS) & result.keys()
    if foreign:
        raise ResultError(
            f"{version} result has {', '.join(sorted(foreign))}, "
            "which belong to another result version"
        )
    if family == _LEGACY:
        for key, ip_family in (("ip4", "4"), ("ip6", "6")):
            if key in result:
                result[key] = _parse_legacy_ip(result[key], key, ip_family)
    else:
        ifaces = _list(result.get("interfaces", []), "interfaces")
        ifaces = [_parse_interface(x, f"interfaces[{i}]", family) for i, x in enumerate(ifaces)]
        ips = _list(result.get("ips", []), "ips")
        ips = [_parse_ipconfig(x, f"ips[{i}]", family, len(ifaces)) for i, x in enumerate(ips)]
        _put(result, "interfaces", ifaces)
        _put(result, "ips", ips)
        _put(result, "routes", _parse_routes(result.get("routes", []), "routes"))
    if "dns" in result:
        _put(result, "dns", _parse_dns(result["dns"]))
    return result


# --- conversion ---------------------------------------------------------------
# Each step takes and returns a parsed result; convert_result sets cniVersion.


def _legacy_to_04(r: dict[str, Any], to_version: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ips: list[dict[str, Any]] = []
    routes: list[dict[str, Any]] = []
    for key, ip_family in (("ip4", "4"), ("ip6", "6")):
        if key in r:
            ipc = r[key]
            ips.append({"version": ip_family, "address": ipc["ip"], **_pick(ipc, "gateway")})
            routes += [_pick(route, "dst", "gw") for route in ipc.get("routes", [])]
    _put(out, "ips", ips)
    _put(out, "routes", routes)
    _put(out, "dns", _pick(r.get("dns", {}), *_DNS_KEYS))
    return out


def _04_to_legacy(r: dict[str, Any], to_version: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ipc in r.get("ips", []):  # legacy results hold one address per family
        key = "ip" + ipc["version"]
        if key not in out:
            out[key] = {"ip": ipc["address"], **_pick(ipc, "gateway")}
    if not out:
        raise ResultError(f"cannot convert result to {to_version}: it has no IP address")
    for route in r.get("routes", []):
        ipc = out.get("ip" + _ip_family(route["dst"]))
        if ipc is not None:
            ipc.setdefault("routes", []).append(_pick(route, "dst", "gw"))
    _put(out, "dns", _pick(r.get("dns", {}), *_DNS_KEYS))
    return out


def _rich_step(r: dict[str, Any], add_version: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Only the 0.4 interface fields cross; mtu, socketPath and pciID do not go down.
    _put(out, "interfaces", [_pick(i, "name", "mac", "sandbox") for i in r.get("interfaces", [])])
    ips = []
    for ipc in r.get("ips", []):
        new = _pick(ipc, "interface", "address", "gateway")
        if add_version:
            new["version"] = _ip_family(ipc["address"])
        ips.append(new)
    _put(out, "ips", ips)
    _put(out, "routes", r.get("routes"))
    _put(out, "dns", _pick(r.get("dns", {}), *_DNS_KEYS))
    return out


def _04_to_v1(r: dict[str, Any], to_version: str) -> dict[str, Any]:
    return _rich_step(r, add_version=False)


def _v1_to_04(r: dict[str, Any], to_version: str) -> dict[str, Any]:
    return _rich_step(r, add_version=True)


_Step = Callable[[dict[str, Any], str], dict[str, Any]]
_UP: dict[int, _Step] = {_LEGACY: _legacy_to_04, _V04: _04_to_v1}
_DOWN: dict[int, _Step] = {_V1: _v1_to_04, _V04: _04_to_legacy}


def convert_result(result: dict[str, Any], to_version: str, *, owned: bool = False
                   ) -> dict[str, Any]:
    """Return `result` (validated) as a `to_version` result, following libcni's rules.

    `owned`: `result` is the caller's to give away (as `parse_result`'s): not copied."""
    target = _family(to_version, "target version")
    version = result.get("cniVersion") if isinstance(result, dict) else None
    if not version:
        raise ResultError("cannot convert a result without cniVersion")
    out = parse_result(result, version, owned=owned)
    family = _FAMILY[out["cniVersion"]]
    while family != target:
        step = (_UP if family < target else _DOWN)[family]
        out = step(out, to_version)
        family += 1 if family < target else -1
    return {"cniVersion": to_version, **{k: v for k, v in out.items() if k != "cniVersion"}}


def with_sandbox(result: Mapping[str, Any], path: str) -> dict[str, Any]:
    """`result` with every interface's non-empty `sandbox` set to `path`.

    Sandboxed interfaces of an attachment are all in its one namespace: plugins
    see it as the pinned handle, the cache and callers as the caller's path.
    """
    out = dict(result)
    ifaces = out.get("interfaces")
    if isinstance(ifaces, list):
        out["interfaces"] = [
            {**i, "sandbox": path} if isinstance(i, dict) and i.get("sandbox") else i
            for i in ifaces
        ]
    return out
