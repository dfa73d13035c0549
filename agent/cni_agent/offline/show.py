"""`cni-agent config show`: the merged configuration, each key with its origin,
and what overrides a key at run time (a saved SetPodCIDRs value hides `pod_cidrs`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from cni_agent.config import DEFAULT, AgentConfig, config_keys, pod_cidrs_path, saved_pod_cidrs


@dataclass(frozen=True)
class SavedPodCIDRs:
    """What the agent would find in state_dir: a value, nothing, or why it cannot tell."""

    path: str
    value: tuple[str, ...] | None = None
    error: str = ""

    def note(self) -> str:
        """The comment under `pod_cidrs`, or "" when the configuration's value is in effect."""
        if self.error:
            return f"# pod_cidrs: {self.error}"
        if self.value is None:
            return ""
        return (f"# pod_cidrs in effect: {_yaml(self.value)}, saved by SetPodCIDRs in {self.path}: "
                "it overrides the line above (`cni-agent pod-cidrs --reset` drops it)")

    def to_json(self) -> dict[str, Any] | None:
        if self.error:
            return {"file": self.path, "error": self.error}
        return None if self.value is None else {"file": self.path, "value": list(self.value)}


def saved(cfg: AgentConfig) -> SavedPodCIDRs:
    path = pod_cidrs_path(cfg.state_dir)
    try:
        return SavedPodCIDRs(path, saved_pod_cidrs(cfg.state_dir))
    except PermissionError:
        return SavedPodCIDRs(path, error="cannot tell whether a value saved by SetPodCIDRs "
                                         f"overrides it: {path}: permission denied (run as root)")
    except ValueError as e:
        # As the agent does: it warns and uses the configuration's value.
        return SavedPodCIDRs(path, error=f"{e}: the agent ignores that file and uses the line above")


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
        if key == "pod_cidrs" and (note := saved(cfg).note()):
            rows.append((note, ""))
    width = max(len(text) for text, origin in rows if origin)
    files = ", ".join(cfg.sources) if cfg.sources else f"none (every key is the {DEFAULT})"
    lines = [f"# files read, in order: {files}"]
    lines += [f"{text.ljust(width)}  # {origin}" if origin else text for text, origin in rows]
    return "\n".join(lines)


def render_json(cfg: AgentConfig) -> str:
    return json.dumps({"files": list(cfg.sources), "config": nested(cfg),
                       "origins": {k: cfg.origin(k) for k in config_keys()},
                       "pod_cidrs_saved": saved(cfg).to_json()}, indent=2)
