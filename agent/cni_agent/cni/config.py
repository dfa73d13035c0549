"""Network configuration files: parsing and directory loading.

Parsing never raises past `load_dir`: an unusable file is kept with its
reason, because the agent shows it to the user instead of hiding it in a log.
"""

from __future__ import annotations

import json
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cni_agent.cni.args import validate_network_name
from cni_agent.cni.errors import ConfigError, InvalidArgument
from cni_agent.cni.result import SUPPORTED_VERSIONS, version_key
from cni_agent.files import Unreadable, read_regular

CONFIG_EXTENSIONS = (".conf", ".conflist", ".json")
MAX_CONFIG_BYTES = 1024 * 1024
# The newest spec version this runtime implements; higher cniVersions entries are dropped.
LATEST_VERSION = "1.1.0"
# The plugin that forwards a runtime's CNI calls to this agent (see `cni_agent.service.cnicall`).
SHIM_TYPE = "cni-agent-shim"
# The cniVersions a conflist of the shim may declare (shim/cni-agent-shim.c answers
# VERSION with the same list; a test compares them).
SHIM_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")


@dataclass(frozen=True)
class PluginConf:
    """One plugin of a list: its type, declared capabilities and raw JSON."""

    type: str
    raw: Mapping[str, Any]
    capabilities: frozenset[str] = frozenset()


@dataclass(frozen=True)
class NetworkConfigList:
    name: str
    cni_version: str
    plugins: tuple[PluginConf, ...]
    raw: Mapping[str, Any]
    # The list's bytes as libcni caches them (base64 in the result cache).
    bytes: bytes = field(repr=False)
    source: str = ""
    disable_check: bool = False
    disable_gc: bool = False

    @property
    def plugin_types(self) -> tuple[str, ...]:
        return tuple(p.type for p in self.plugins)


@dataclass(frozen=True)
class InvalidNetwork:
    """A file that could not be used, and why, in words for a user."""

    source: str
    reason: str
    name: str = ""


@dataclass(frozen=True)
class LoadedDir:
    networks: tuple[NetworkConfigList, ...]
    invalid: tuple[InvalidNetwork, ...]


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxdict = 4


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its start only (a file holds up to 1 MiB)."""
    text = _SHORT.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bool_field(source: str, obj: Mapping[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(source, f'"{key}" must be true or false, not {_shown(value)}')


def _pick_version(source: str, obj: Mapping[str, Any]) -> str:
    """The list's version: as libcni, the highest supported one of `cniVersions`
    and `cniVersion` together (a list may name its newest version in either)."""
    versions = obj.get("cniVersions")
    version = obj.get("cniVersion")
    if versions is not None:
        if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
            raise ConfigError(source, '"cniVersions" must be a list of version strings')
        candidates = [*versions, *([version] if isinstance(version, str) else [])]
        usable: list[str] = [v for v in candidates if v in SUPPORTED_VERSIONS]
        if usable:
            return max(usable, key=version_key)
        if "cniVersion" not in obj:
            raise ConfigError(source, f'no supported version in "cniVersions" {_shown(versions)}')
    if not isinstance(version, str) or not version:
        raise ConfigError(source, '"cniVersion" is missing')
    if version not in SUPPORTED_VERSIONS:
        raise ConfigError(source, f"cniVersion {_shown(version)} is not supported "
                                  f"(supported: {', '.join(SUPPORTED_VERSIONS)})")
    return version


def _plugin(source: str, index: int, raw: Any) -> PluginConf:
    if not isinstance(raw, dict):
        raise ConfigError(source, f"plugin #{index + 1} is not a JSON object")
    ptype = raw.get("type")
    if not isinstance(ptype, str) or not ptype:
        raise ConfigError(source, f'plugin #{index + 1} has no "type"')
    if "/" in ptype or ptype in (".", ".."):
        raise ConfigError(source, f"plugin #{index + 1} has an invalid type {_shown(ptype)}")
    caps = raw.get("capabilities", {})
    if not isinstance(caps, dict):
        raise ConfigError(source, f'plugin {ptype}: "capabilities" must be an object')
    declared = frozenset(k for k, v in caps.items() if v is True)
    return PluginConf(type=ptype, raw=raw, capabilities=declared)


def parse_list(data: bytes, source: str = "<bytes>") -> NetworkConfigList:
    """Parse a `.conflist`."""
    obj = _load_object(data, source)
    return _list_from_object(obj, data, source)


def parse_list_or_none(data: bytes, source: str = "<bytes>") -> NetworkConfigList | None:
    """`parse_list`, or None when the bytes are not a usable list (stored configs)."""
    try:
        return parse_list(data, source)
    except ConfigError:
        return None


def parse_single(data: bytes, source: str = "<bytes>") -> NetworkConfigList:
    """Parse a `.conf`/`.json` holding one plugin; it becomes a one-plugin list."""
    obj = _load_object(data, source)
    if "plugins" in obj:
        # Users do put lists in .conf files; libcni accepts that too.
        return _list_from_object(obj, data, source)
    if not isinstance(obj.get("type"), str):
        raise ConfigError(source, 'a single-plugin config needs a "type"')
    wrapped: dict[str, Any] = {"name": obj.get("name"), "plugins": [obj]}
    for key in ("cniVersion", "cniVersions", "disableCheck", "disableGC"):
        if key in obj:
            wrapped[key] = obj[key]
    raw = json.dumps(wrapped, separators=(",", ":")).encode()
    return _list_from_object(wrapped, raw, source)


def parse_file(path: str, data: bytes) -> NetworkConfigList:
    if path.endswith(".conflist"):
        return parse_list(data, path)
    return parse_single(data, path)


def _load_object(data: bytes, source: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(source, f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(source, "not a JSON object")
    return obj


def _list_from_object(obj: dict[str, Any], data: bytes, source: str) -> NetworkConfigList:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(source, '"name" is missing')
    try:
        validate_network_name(name, "name")
    except InvalidArgument as e:
        raise ConfigError(source, f"invalid network name: {e.reason}") from None
    version = _pick_version(source, obj)
    plugins = obj.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise ConfigError(source, '"plugins" must be a non-empty list')
    return NetworkConfigList(
        name=name,
        cni_version=version,
        plugins=tuple(_plugin(source, i, p) for i, p in enumerate(plugins)),
        raw=obj,
        bytes=data,
        source=source,
        disable_check=_bool_field(source, obj, "disableCheck"),
        disable_gc=_bool_field(source, obj, "disableGC"),
    )


def config_files(conf_dir: str) -> list[str]:
    """Config file paths in load order; a missing directory has none."""
    try:
        names = os.listdir(conf_dir)
    except FileNotFoundError:
        return []
    return [
        os.path.join(conf_dir, n)
        for n in sorted(names)  # byte order, as libcni: "10-x" before "5-x"
        if n.endswith(CONFIG_EXTENSIONS) and not n.startswith(".")
    ]


def read_config(path: str) -> NetworkConfigList:
    """Parse one network file (a regular file only: see `files.read_regular`)."""
    try:
        data = read_regular(path, MAX_CONFIG_BYTES)
    except Unreadable as e:
        raise ConfigError(path, str(e)) from None
    return parse_file(path, data)


def load_dir(conf_dir: str) -> LoadedDir:
    """Parse every config file of a directory (blocking; run it in a thread).

    A directory that exists but cannot be listed is reported as one invalid
    entry, so the user learns why there are no networks.
    """
    networks: list[NetworkConfigList] = []
    invalid: list[InvalidNetwork] = []
    try:
        paths = config_files(conf_dir)
    except OSError as e:
        return LoadedDir((), (InvalidNetwork(conf_dir, f"cannot list directory: {e.strerror}"),))
    seen: dict[str, str] = {}
    for path in paths:
        if os.path.isdir(path):
            continue
        try:
            net = read_config(path)
        except ConfigError as e:
            invalid.append(InvalidNetwork(path, e.reason))
            continue
        if net.name in seen:
            invalid.append(InvalidNetwork(
                path, f"network {net.name!r} is already defined by {seen[net.name]}", net.name
            ))
            continue
        seen[net.name] = path
        networks.append(net)
    return LoadedDir(tuple(networks), tuple(invalid))
