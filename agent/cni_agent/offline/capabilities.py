"""`cni-agent shim-config`'s look at the agent's network: the capabilities its
plugins declare, read from `conf_dir` as the daemon reads it (the agent's
configuration layers, or --config FILE). A runtime passes a capability only
to a plugin of its own list that declares it, so the shim's list must declare
what the agent's plugins want; nothing runs, no bus is needed.
"""

from __future__ import annotations

from cni_agent.cni.config import SHIM_TYPE, load_dir
from cni_agent.config import ConfigFileError, load_config


def network_capabilities(config: str | None, network: str) -> tuple[frozenset[str] | None, str]:
    """(the union of what the plugins of `network` declare, where it was read), or
    (None, why it could not be); `network` "" is the agent's default network."""
    try:
        cfg = load_config(config)
    except ConfigFileError as e:
        return None, str(e)
    loaded = load_dir(cfg.conf_dir)
    # A network that runs the shim is refused by the agent: never its default.
    usable = [n for n in loaded.networks if SHIM_TYPE not in n.plugin_types]
    wanted = network or cfg.default_network
    if wanted:
        found = next((n for n in usable if n.name == wanted), None)
    else:
        found = usable[0] if usable else None
    if found is None:
        what = f"network {wanted}" if wanted else "a default network"
        return None, f"{what} not found in {cfg.conf_dir} (conf_dir of the agent's configuration)"
    caps = frozenset(c for p in found.plugins for c in p.capabilities)
    return caps, f"network {found.name}, {found.source}"


def state_dir(config: str | None) -> tuple[str | None, str]:
    """The agent's state_dir, where cni-agent-shim queues a DEL while no agent
    runs; (None, why) when the configuration cannot be read."""
    try:
        return load_config(config).state_dir, ""
    except ConfigFileError as e:
        return None, str(e)
