"""A reload (SIGHUP, `Reload`): which re-read keys take effect at once.

The ones that only steer what happens next do (the default network, the
monitor's timing, who may call, the log level, the drain, the pod CIDRs
given to the next ADDs, the HTTP face's TLS and users); the others name
resources already in use (directories, the bus, the HTTP listener, the
runtime's deadlines) and wait for a restart, which the log says.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from cni_agent.config import AgentConfig, config_keys

log = logging.getLogger(__name__)

LIVE = ("default_network", "monitor", "access", "log_level", "shutdown_drain", "pod_cidrs",
        # Only the key of its section: the listener's address stays until a restart.
        "http.web_config")


def _live(key: str) -> bool:
    return key in LIVE or key.partition(".")[0] in LIVE


def changed_keys(old: AgentConfig, new: AgentConfig) -> list[str]:
    return [k for k in config_keys() if old.value(k) != new.value(k)]


def merge(old: AgentConfig, new: AgentConfig,
          apply: Callable[[AgentConfig], None]) -> AgentConfig:
    """The configuration in effect after a reload: `new`'s live keys, `old`'s others.

    `apply` puts the live keys into the running parts; the rest are logged.
    """
    changed = changed_keys(old, new)
    later = [k for k in changed if not _live(k)]
    sections: dict[str, dict[str, object]] = {}
    for key in LIVE:
        section, _, sub = key.partition(".")
        if sub:
            sections.setdefault(section, {})[sub] = getattr(getattr(new, section), sub)
    effective = old.replace(
        **{k: getattr(new, k) for k in LIVE if "." not in k},
        **{s: dataclasses.replace(getattr(old, s), **subs) for s, subs in sections.items()},
        sources=new.sources, origins=new.origins)
    apply(effective)
    for key in changed:
        if key not in later:
            log.info("reload: %s is now %r (%s)", key, new.value(key), new.origin(key))
    for key in later:
        log.warning("reload: %s changed to %r (%s); it takes effect at the next restart",
                    key, new.value(key), new.origin(key))
    return effective
