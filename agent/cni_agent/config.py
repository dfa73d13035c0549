"""The agent's YAML configuration, layered as systemd layers its own.

Read in order, later files winning key by key: `/usr/lib/cni-agent/agent.yaml`
(the package's defaults), `/etc/cni-agent/agent.yaml` (the admin's), then the
drop-ins `*.yaml` of `/usr/lib/cni-agent/agent.yaml.d/` and
`/etc/cni-agent/agent.yaml.d/` in lexical order of file name, a name in /etc
masking the same name in /usr/lib (`layers.py` finds the files). Each file is
checked on its own, so an error names the file and the key: a typo must stop
startup, not be ignored.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import json
import math
import os
import re
import reprlib
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from cni_agent import files
from cni_agent.config_layers import ETC_DIR, USR_DIR, config_files

DEFAULT_CONFIG_PATH = "/etc/cni-agent/agent.yaml"
MAX_FILE_BYTES = 1024 * 1024  # per configuration file: an agent.yaml is a few hundred bytes
# Values of one document, an alias counted as what it stands for: YAML aliases
# expand (a 411-byte "billion laughs" is billions of values), and printing one
# in an error message took seconds and hundreds of MiB.
MAX_YAML_VALUES = 10_000
DEFAULT = "default"  # the origin of a key no file sets
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigFileError(Exception):
    """The configuration file is unusable; the message is one line for the user."""


@dataclass(frozen=True)
class MonitorConfig:
    startup_interval: float = 0.5
    interval: float = 5.0
    grace_period: float = 0.0


@dataclass(frozen=True)
class TimeoutsConfig:
    add: float = 120.0
    # "del" is a Python keyword: the YAML key maps to this field.
    delete: float = 60.0
    check: float = 30.0
    status: float = 10.0
    gc: float = 60.0
    version: float = 10.0
    lock: float = 60.0
    ready: float = 30.0


@dataclass(frozen=True)
class AccessConfig:
    # Besides root, these groups' members may set up sandboxes (their own).
    groups: tuple[str, ...] = ("cni-agent",)
    # What callers that are not root may use: these networks (default none:
    # the admin opens them), these capabilities (default none: portMappings,
    # ips, mac, ipRanges, … reach host-wide state), and this many sandboxes per uid.
    networks: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    max_sandboxes: int = 16
    # Attachments one such uid may hold across its sandboxes (Setup and Attach alike).
    max_attachments: int = 16
    # The share of a network's addresses (where its IPAM config gives the pool
    # size) all such callers together may hold: the rest is root's reserve.
    members_share: float = 0.5
    # Host ports they may map ("20000-20999", "8080"; default none), when
    # portMappings is among their capabilities.
    host_ports: tuple[str, ...] = ()
    # CNI_ARGS keys they may pass besides IgnoreUnknown (IP and MAC: through
    # their capabilities); K8S_* and the pod option only if listed.
    cni_args: tuple[str, ...] = ()
    # Opened networks the agent cannot filter spoofing on (not a bridge, or no
    # nftables), which members may use all the same.
    unprotected_networks: tuple[str, ...] = ()

    def port_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(parse_port_range(r) for r in self.host_ports)


@dataclass(frozen=True)
class GCConfig:
    # Networks the GC verb is sent to: names, or "*". Default none: on a node
    # whose conf dir a runtime shares, GC would release the runtime's pods.
    networks: tuple[str, ...] = ()
    # Seconds between reaping passes (dead namespaces, unfinished or damaged
    # records), whether anyone calls or not; 0 turns them off.
    interval: float = 60.0


@dataclass(frozen=True)
class CheckConfig:
    # Seconds between CHECK passes over every ready attachment (with ±10%
    # jitter); 0 turns off all CHECKs the agent runs unasked (scheduled, after
    # a firewalld reload, the baseline right after ADD).
    interval: float = 300.0
    # Re-create a drifted attachment (DEL, then ADD asking for its IPs and MAC).
    repair: bool = False
    # Also where the network cannot be asked for the same IP (no plugin
    # declares the ips capability): the re-ADD may give another address, and
    # is reported repaired-with-new-address. Off: such drift is only reported.
    repair_new_address: bool = False
    # Sandboxes CHECKed at once in a pass.
    concurrency: int = 4


@dataclass(frozen=True)
class HTTPConfig:
    # "" (off), HOST:PORT or unix:/PATH: /healthz, /readyz and /metrics.
    listen: str = ""
    # "" (none) or the path of a file in the Prometheus exporter-toolkit's
    # web-config format: TLS and basic auth for `listen` (webconfig.py reads it).
    web_config: str = ""


@dataclass(frozen=True)
class TracingConfig:
    # "" (off) or an OTLP/HTTP collector's URL: a span per call and per plugin
    # execution is exported there (needs the OpenTelemetry SDK).
    otlp_endpoint: str = ""

    def traces_url(self) -> str:
        """Where spans are sent: the URL as given, or with the OTLP traces path
        (/v1/traces) when it has no path, as OTEL_EXPORTER_OTLP_ENDPOINT is read."""
        url = self.otlp_endpoint
        if urllib.parse.urlsplit(url).path in ("", "/"):
            return url.rstrip("/") + "/v1/traces"
        return url


# What exporting spans needs: the SDK and its OTLP/HTTP exporter (the optional
# extra `tracing`; Fedora's python3-opentelemetry-sdk; not in Debian 12).
TRACING_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


def tracing_sdk_missing() -> str:
    """"" when spans can be exported, else what is missing (finds the modules,
    imports only their packages)."""
    for name in TRACING_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return (f"the OpenTelemetry SDK is not installed ({name} is missing: install "
                    "python3-opentelemetry-sdk, or pip's opentelemetry-sdk and "
                    "opentelemetry-exporter-otlp-proto-http)")
    return ""


def parse_port_range(text: str) -> tuple[int, int]:
    """`FIRST-LAST` or one `PORT`, 1 to 65535: (first, last); ValueError saying why."""
    first, sep, last = text.partition("-")
    if not first.isdigit() or (sep and not last.isdigit()) or not first.isascii() \
            or not last.isascii():
        raise ValueError("must be a port (8080) or a range of ports (20000-20999)")
    lo, hi = int(first), int(last) if sep else int(first)
    if not 0 < lo <= 65535 or not 0 < hi <= 65535:
        raise ValueError("ports are 1 to 65535")
    if lo > hi:
        raise ValueError("the range's first port is above its last")
    return lo, hi


def parse_listen(text: str) -> tuple[str, int] | str:
    """`HOST:PORT`, `[V6]:PORT` or `unix:/PATH`: (host, port), or the socket path."""
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError("the socket path must be absolute")
        return path
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("must be HOST:PORT or unix:/PATH")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class AgentConfig:
    conf_dir: str = "/etc/cni/net.d"
    plugin_dirs: tuple[str, ...] = ("/opt/cni/bin", "/usr/libexec/cni", "/usr/lib/cni")
    state_dir: str = "/var/lib/cni-agent"
    runtime_dir: str = "/run/cni-agent"
    default_network: str = ""
    fallback_network: bool = False
    pod_cidrs: tuple[str, ...] = ()
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    shutdown_drain: float = 10.0
    access: AccessConfig = field(default_factory=AccessConfig)
    gc: GCConfig = field(default_factory=GCConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Whose bridge attachments get anti-spoofing filters: "members" (callers
    # that are not root) or "all" (root's too). There is no off.
    antispoof: str = "members"
    bus: str = "system"
    log_level: str = "info"
    # The files read, in order, and which of them set each key ("timeouts.del":
    # FILE); keys no file sets come from the defaults above.
    sources: tuple[str, ...] = field(default=(), compare=False)
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)

    def replace(self, **changes: Any) -> AgentConfig:
        return dataclasses.replace(self, **changes)

    def origin(self, key: str) -> str:
        return self.origins.get(key, DEFAULT)

    def value(self, key: str) -> Any:
        """The value of a dotted key as YAML spells it (`timeouts.del`)."""
        section, _, sub = key.partition(".")
        value = getattr(self, section)
        return getattr(value, _KEY_ALIASES.get(sub, sub)) if sub else value


def config_keys() -> Iterator[str]:
    """Every key, dotted for those of a section, in the order of the documentation."""
    for f in dataclasses.fields(AgentConfig):
        if f.name in ("sources", "origins"):
            continue
        if f.name in _SECTIONS:
            for sub in _SECTIONS[f.name][1]:
                yield f"{f.name}.{sub}"
        else:
            yield f.name


_KEY_ALIASES = {"del": "delete"}


def _fail(source: str, key: str, what: str) -> ConfigFileError:
    return ConfigFileError(f"{source}: {key}: {what}")


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its start only (bounded work too)."""
    text = _SHORT.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _duration(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(source, key, f"must be a number of seconds, not {_shown(value)}")
    if value < 0 or not math.isfinite(value):
        raise _fail(source, key, f"must be a non-negative number of seconds, not {_shown(value)}")
    return float(value)


def _interval(source: str, key: str, value: Any) -> float:
    seconds = _duration(source, key, value)
    if seconds == 0:
        raise _fail(source, key, "must be greater than 0 (it is a polling interval)")
    return seconds


def _string(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(source, key, f"must be a string, not {_shown(value)}")
    return value


def _path(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if not text.startswith("/"):
        raise _fail(source, key, f"must be an absolute path, not {_shown(text)}")
    return text


def _bool(source: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(source, key, f"must be true or false, not {_shown(value)}")
    return value


def _str_list(source: str, key: str, value: Any, item: Any = _string) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _fail(source, key, f"must be a list, not {_shown(value)}")
    return tuple(item(source, f"{key}[{i}]", v) for i, v in enumerate(value))


def _cidr(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise _fail(source, key, f"{_shown(text)} is not a CIDR") from None


def _listen(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if text:
        try:
            parse_listen(text)
        except ValueError as e:
            raise _fail(source, key, f"{_shown(text)}: {e}") from None
    return text


def _optional_path(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    return _path(source, key, text) if text else text


def _otlp_endpoint(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if text:
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.query \
                or parts.fragment or any(c.isspace() for c in text):
            raise _fail(source, key, f"must be an http:// or https:// URL (an OTLP/HTTP "
                                     f"collector, as http://localhost:4318), not {_shown(text)}")
    return text


def _port_range(source: str, key: str, value: Any) -> str:
    # A single port is a YAML number as often as a string: both are taken.
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    text = _string(source, key, text)
    try:
        parse_port_range(text)
    except ValueError as e:
        raise _fail(source, key, f"{_shown(text)}: {e}") from None
    return text


# As CNI_ARGS carries keys to plugins (cni/args.py refuses any other in a call).
_ARG_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
# Keys a capability opens, not this list (sandboxes/policy.py's ARG_CAPABILITIES).
_CAPABILITY_ARGS = {"IP": "ips", "MAC": "mac"}


def _arg_key(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if not _ARG_KEY.fullmatch(text):
        raise _fail(source, key, f"{_shown(text)} is not a CNI_ARGS key (letters, digits, '_', "
                                 "'.' and '-')")
    if (cap := _CAPABILITY_ARGS.get(text.upper())) is not None:
        raise _fail(source, key, f"{text} does what capability {cap!r} does: open it with "
                                 "access.capabilities instead")
    return text


def _at_least(least: int) -> Callable[[str, str, Any], int]:
    def check(source: str, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise _fail(source, key, f"must be a whole number of at least {least}, not {_shown(value)}")
        return value
    return check


_positive_int, _count = _at_least(1), _at_least(0)


def _share(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise _fail(source, key, f"must be a number from 0 to 1 (a share of a network's "
                                 f"addresses, 0.5 for half), not {_shown(value)}")
    return float(value)


ANTISPOOF_MODES = ("members", "all")


def _antispoof(source: str, key: str, value: Any) -> str:
    # YAML reads an unquoted `off` or `no` as false: the same answer for it.
    if not isinstance(value, str) or value not in ANTISPOOF_MODES:
        raise _fail(source, key, f"must be one of {', '.join(ANTISPOOF_MODES)} (there is no "
                                 f"off: see access.unprotected_networks), not {_shown(value)}")
    return value


def _log_level(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value).lower()
    if text not in LOG_LEVELS:
        raise _fail(source, key, f"must be one of {', '.join(LOG_LEVELS)}, not {_shown(value)}")
    return text


_Check = Callable[[str, str, Any], Any]
_TOP_LEVEL: Mapping[str, _Check] = {
    "conf_dir": _path,
    "plugin_dirs": lambda s, k, v: _str_list(s, k, v, _path),
    "state_dir": _path,
    "runtime_dir": _path,
    "default_network": _string,
    "fallback_network": _bool,
    "pod_cidrs": lambda s, k, v: _str_list(s, k, v, _cidr),
    "shutdown_drain": _duration,
    "antispoof": _antispoof,
    "bus": _string,
    "log_level": _log_level,
}
_SECTIONS: dict[str, tuple[type[Any], Mapping[str, _Check]]] = {
    "monitor": (MonitorConfig, {"startup_interval": _interval, "interval": _interval,
                                "grace_period": _duration}),
    "timeouts": (TimeoutsConfig, {"del" if f.name == "delete" else f.name: _duration
                                  for f in dataclasses.fields(TimeoutsConfig)}),
    "access": (AccessConfig, {"groups": _str_list, "networks": _str_list,
                              "capabilities": _str_list, "max_sandboxes": _count,
                              "max_attachments": _count, "members_share": _share,
                              "host_ports": lambda s, k, v: _str_list(s, k, v, _port_range),
                              "cni_args": lambda s, k, v: _str_list(s, k, v, _arg_key),
                              "unprotected_networks": _str_list}),
    "gc": (GCConfig, {"networks": _str_list, "interval": _duration}),
    "check": (CheckConfig, {"interval": _duration, "repair": _bool,
                            "repair_new_address": _bool, "concurrency": _positive_int}),
    "http": (HTTPConfig, {"listen": _listen, "web_config": _optional_path}),
    "tracing": (TracingConfig, {"otlp_endpoint": _otlp_endpoint}),
}


def _flatten(doc: Any, source: str) -> dict[str, Any]:
    """One file's keys, checked and typed, dotted inside sections: what it sets."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{source}: the top level must be a mapping of keys")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _TOP_LEVEL:
            out[key] = _TOP_LEVEL[key](source, key, value)
        elif key in _SECTIONS:
            table = _SECTIONS[key][1]
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _fail(source, key, "must be a mapping")
            for k, v in value.items():
                if k not in table:
                    raise _fail(source, f"{key}.{_shown(k).strip(chr(39))}", "unknown key")
                out[f"{key}.{k}"] = table[k](source, f"{key}.{k}", v)
        else:
            raise _fail(source, _shown(key).strip("'"), "unknown key")
    return out


def _build(values: Mapping[str, Any], origins: Mapping[str, str], sources: Sequence[str]) -> AgentConfig:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, _, sub = key.partition(".")
        if sub:
            sections.setdefault(section, {})[_KEY_ALIASES.get(sub, sub)] = value
        else:
            top[key] = value
    for name, sub_values in sections.items():
        top[name] = _SECTIONS[name][0](**sub_values)
    return AgentConfig(**top, sources=tuple(sources), origins=dict(origins))


def parse_config(doc: Any, source: str) -> AgentConfig:
    """One parsed document as the whole configuration."""
    values = _flatten(doc, source)
    return _build(values, dict.fromkeys(values, source), (source,))


def read_regular(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """A regular file's bytes, at most `limit`; ConfigFileError naming the file."""
    try:
        return files.read_regular(path, limit)
    except files.Unreadable as e:
        raise ConfigFileError(f"{path}: {'no such file' if e.missing else e}") from None


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _values(node: yaml.Node, path: str) -> int:
    """How many values `node` stands for, aliases expanded (each shared node is
    counted once per use, computed once); ConfigFileError past MAX_YAML_VALUES
    or for an alias that contains itself."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    open_: set[int] = set()
    while stack:
        n, done = stack.pop()
        if id(n) in sizes:
            continue
        kids: list[yaml.Node] = []
        if isinstance(n, yaml.SequenceNode):
            kids = list(n.value)
        elif isinstance(n, yaml.MappingNode):
            kids = [x for pair in n.value for x in pair]
        if done:
            open_.discard(id(n))
            sizes[id(n)] = total = 1 + sum(sizes[id(k)] for k in kids)
            if total > MAX_YAML_VALUES:
                raise ConfigFileError(f"{path}: more than {MAX_YAML_VALUES} values once its "
                                      "aliases are expanded: not read")
            continue
        if id(n) in open_:
            raise ConfigFileError(f"{path}: a YAML alias refers to a value that contains it")
        open_.add(id(n))
        stack.append((n, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)
    return sizes[id(node)]


def read_document(path: str) -> Any:
    """A file's YAML document (None when empty); ConfigFileError naming the file."""
    data = read_regular(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigFileError(f"{path}: not valid YAML: not UTF-8 text") from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _values(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigFileError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except RecursionError:
        raise ConfigFileError(f"{path}: not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()


def load_config(path: str | None = None, *, dirs: Sequence[str] = (USR_DIR, ETC_DIR)) -> AgentConfig:
    """The merged configuration: `path` and `path.d/`, or else the layers of `dirs`.

    Maps (the sections) merge key by key; lists and scalars replace. A missing
    layer is simply absent; a missing `path` is an error.
    """
    if path is not None and not os.path.lexists(path):
        raise ConfigFileError(f"{path}: no such file")
    try:
        files = config_files(path, dirs)
    except OSError as e:
        raise ConfigFileError(f"{e.filename}: cannot list the drop-in directory: {e.strerror}") from None
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for source in files:
        for key, value in _flatten(read_document(source), source).items():
            values[key] = value
            origins[key] = source
    return _build(values, origins, files)


POD_CIDRS_FILE = "pod-cidrs.json"  # in state_dir: SetPodCIDRs' value, which overrides pod_cidrs


def pod_cidrs_path(state_dir: str) -> str:
    return os.path.join(state_dir, POD_CIDRS_FILE)


def saved_pod_cidrs(state_dir: str) -> tuple[str, ...] | None:
    """The pod CIDRs SetPodCIDRs saved, which override the `pod_cidrs` key;
    None when nothing is saved. ValueError when the file is unusable (a
    damaged file must not decide the node's ranges: the config's stand);
    PermissionError when the caller may not read it (not root)."""
    path = pod_cidrs_path(state_dir)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except PermissionError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    try:  # checked as the pod_cidrs key is
        return _str_list(path, "cidrs", doc.get("cidrs") if isinstance(doc, dict) else None, _cidr)
    except ConfigFileError as e:
        raise ValueError(str(e)) from None
