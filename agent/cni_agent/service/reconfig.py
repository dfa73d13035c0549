"""A reload (SIGHUP, `Reload`): which re-read keys take effect at once.

The ones that only steer what happens next do (the default network, the
monitor's timing, who may call, the log level, the drain, the pod CIDRs
given to the next ADDs); the others name
resources already in use (directories, the bus, the HTTP listener, the
runtime's deadlines) and wait for a restart, which the log says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cni_agent.config import AgentConfig, config_keys

log = logging.getLogger(__name__)

LIVE = ("default_network", "monitor", "access", "log_level", "shutdown_drain", "pod_cidrs")


def changed_keys(old: AgentConfig, new: AgentConfig) -> list[str]:
    return [k for k in config_keys() if old.value(k) != new.value(k)]


def merge(old: AgentConfig, new: AgentConfig,
          apply: Callable[[AgentConfig], None]) -> AgentConfig:
    """The configuration in effect after a reload: `new`'s live keys, `old`'s others.

    `apply` puts the live keys into the running parts; the rest are logged.
    """
    changed = changed_keys(old, new)
    later = [k for k in changed if k.partition(".")[0] not in LIVE]
    effective = old.replace(**{k: getattr(new, k) for k in LIVE},
                            sources=new.sources, origins=new.origins)
    apply(effective)
    for key in changed:
        if key not in later:
            log.info("reload: %s is now %r (%s)", key, new.value(key), new.origin(key))
    for key in later:
        log.warning("reload: %s changed to %r (%s); it takes effect at the next restart",
                    key, new.value(key), new.origin(key))
    return effective
