"""`cni-agent config show`: the merged configuration, each key with its origin."""

from __future__ import annotations

import json
from typing import Any

import yaml

from cni_agent.config import DEFAULT, AgentConfig, config_keys


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 120, not 120.0: as the documentation writes it
    return value


def _yaml(value: Any) -> str:
    return yaml.safe_dump(_plain(value), default_flow_style=True, width=10_000).strip() \
        .removesuffix("\n...").strip()


def nested(cfg: AgentConfig) -> dict[str, Any]:
    """The configuration as a YAML document would spell it, sections as maps."""
    out: dict[str, Any] = {}
    for key in config_keys():
        section, _, sub = key.partition(".")
        if sub:
            out.setdefault(section, {})[sub] = _plain(cfg.value(key))
        else:
            out[key] = _plain(cfg.value(key))
    return out


def render_text(cfg: AgentConfig) -> str:
    """Valid YAML (it loads back to the same configuration), each key's origin
    as a comment on its line."""
    rows: list[tuple[str, str]] = []
    section_shown = ""
    for key in config_keys():
        section, _, sub = key.partition(".")
        if sub and section != section_shown:
            rows.append((f"{section}:", ""))
            section_shown = section
        label = f"  {sub}" if sub else key
        rows.append((f"{label}: {_yaml(cfg.value(key))}", cfg.origin(key)))
    width = max(len(text) for text, origin in rows if origin)
    files = ", ".join(cfg.sources) if cfg.sources else f"none (every key is the {DEFAULT})"
    lines = [f"# files read, in order: {files}"]
    lines += [f"{text.ljust(width)}  # {origin}" if origin else text for text, origin in rows]
    return "\n".join(lines)


def render_json(cfg: AgentConfig) -> str:
    return json.dumps({"files": list(cfg.sources), "config": nested(cfg),
                       "origins": {k: cfg.origin(k) for k in config_keys()}}, indent=2)
