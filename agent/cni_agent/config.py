"""The agent's YAML configuration (`/etc/cni-agent/agent.yaml`).

A table of typed fields, frozen dataclasses, and one error type whose message
names the file and the key: a typo must stop startup, not be ignored.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

DEFAULT_CONFIG_PATH = "/etc/cni-agent/agent.yaml"
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
    groups: tuple[str, ...] = ("cni-agent",)


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
    # Sandboxes CHECKed at once in a pass.
    concurrency: int = 4


@dataclass(frozen=True)
class HTTPConfig:
    # "" (off), HOST:PORT or unix:/PATH: /healthz, /readyz and /metrics.
    listen: str = ""


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
    bus: str = "system"
    log_level: str = "info"
    source: str = "(defaults)"

    def replace(self, **changes: Any) -> AgentConfig:
        return dataclasses.replace(self, **changes)


_KEY_ALIASES = {"del": "delete"}


def _fail(source: str, key: str, what: str) -> ConfigFileError:
    return ConfigFileError(f"{source}: {key}: {what}")


def _duration(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(source, key, f"must be a number of seconds, not {value!r}")
    if value < 0 or not math.isfinite(value):
        raise _fail(source, key, f"must be a non-negative number of seconds, not {value!r}")
    return float(value)


def _string(source: str, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(source, key, f"must be a string, not {value!r}")
    return value


def _path(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if not text.startswith("/"):
        raise _fail(source, key, f"must be an absolute path, not {text!r}")
    return text


def _bool(source: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(source, key, f"must be true or false, not {value!r}")
    return value


def _str_list(source: str, key: str, value: Any, item: Any = _string) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise _fail(source, key, f"must be a list, not {value!r}")
    return tuple(item(source, f"{key}[{i}]", v) for i, v in enumerate(value))


def _cidr(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise _fail(source, key, f"{text!r} is not a CIDR") from None


def _listen(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value)
    if text:
        try:
            parse_listen(text)
        except ValueError as e:
            raise _fail(source, key, f"{text!r}: {e}") from None
    return text


def _positive_int(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(source, key, f"must be a whole number of at least 1, not {value!r}")
    return value


def _log_level(source: str, key: str, value: Any) -> str:
    text = _string(source, key, value).lower()
    if text not in LOG_LEVELS:
        raise _fail(source, key, f"must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
    return text


_TOP_LEVEL = {
    "conf_dir": _path,
    "plugin_dirs": lambda s, k, v: _str_list(s, k, v, _path),
    "state_dir": _path,
    "runtime_dir": _path,
    "default_network": _string,
    "fallback_network": _bool,
    "pod_cidrs": lambda s, k, v: _str_list(s, k, v, _cidr),
    "shutdown_drain": _duration,
    "bus": _string,
    "log_level": _log_level,
}
_SECTIONS: dict[str, tuple[type[Any], Mapping[str, Any]]] = {
    "monitor": (MonitorConfig, {f.name: _duration for f in dataclasses.fields(MonitorConfig)}),
    "timeouts": (TimeoutsConfig, {"del" if f.name == "delete" else f.name: _duration
                                  for f in dataclasses.fields(TimeoutsConfig)}),
    "access": (AccessConfig, {"groups": _str_list}),
    "gc": (GCConfig, {"networks": _str_list, "interval": _duration}),
    "check": (CheckConfig, {"interval": _duration, "repair": _bool,
                            "concurrency": _positive_int}),
    "http": (HTTPConfig, {"listen": _listen}),
}


def parse_config(doc: Any, source: str) -> AgentConfig:
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigFileError(f"{source}: the top level must be a mapping of keys")
    values: dict[str, Any] = {"source": source}
    for key, value in doc.items():
        if key in _TOP_LEVEL:
            values[key] = _TOP_LEVEL[key](source, key, value)
        elif key in _SECTIONS:
            cls, table = _SECTIONS[key]
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise _fail(source, key, "must be a mapping")
            sub: dict[str, Any] = {}
            for k, v in value.items():
                if k not in table:
                    raise _fail(source, f"{key}.{k}", "unknown key")
                sub[_KEY_ALIASES.get(str(k), str(k))] = table[k](source, f"{key}.{k}", v)
            values[key] = cls(**sub)
        else:
            raise _fail(source, str(key), "unknown key")
    cfg = AgentConfig(**values)
    if cfg.monitor.interval == 0 or cfg.monitor.startup_interval == 0:
        raise _fail(source, "monitor", "intervals must be greater than 0")
    return cfg


def load_config(path: str | None) -> AgentConfig:
    """Read the file; a missing default file means all defaults."""
    source = path or DEFAULT_CONFIG_PATH
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if path is None:
            return AgentConfig()
        raise ConfigFileError(f"{source}: no such file") from None
    except OSError as e:
        raise ConfigFileError(f"{source}: cannot read: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigFileError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return parse_config(doc, source)
