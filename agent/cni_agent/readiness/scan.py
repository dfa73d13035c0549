"""One look at the disk: the trusted plugin dirs, the valid networks, the default.

No STATUS here (that is per network, `polls.py`), so a scan is quick and a
file event is decided without waiting for any plugin but a new binary's
VERSION (cached per binary identity).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from cni_agent.cni.config import InvalidNetwork, NetworkConfigList, load_dir
from cni_agent.cni.errors import ConfigError
from cni_agent.cni.runtime import CNIRuntime
from cni_agent.readiness.reasons import DEFAULT_INVALID, DEFAULT_NOT_FOUND, NO_NETWORK


@dataclass(frozen=True)
class Scan:
    """What one look at the disk found."""

    networks: tuple[NetworkConfigList, ...]  # valid ones in load order, then the fallback if used
    invalid: tuple[InvalidNetwork, ...]
    default: NetworkConfigList | None
    error: str  # why there is no usable default; "" when there is one
    refused_dirs: tuple[tuple[str, str], ...] = ()  # plugin dirs left out of CNI_PATH, and why
    reason: str = ""  # `error` as one of the monitor's REASONS ("" when there is a default)


async def read_disk(runtime: CNIRuntime, conf_dir: str, pinned: str,
                    fallback: NetworkConfigList | None) -> Scan:
    # Plugin dirs first: validation and STATUS look only in trusted ones.
    refused = (await asyncio.to_thread(runtime.refresh_plugin_path)).untrusted
    loaded = await asyncio.to_thread(load_dir, conf_dir)
    valid: list[NetworkConfigList] = []
    invalid = list(loaded.invalid)
    for net in loaded.networks:
        try:
            await runtime.validate(net)
        except ConfigError as e:
            invalid.append(InvalidNetwork(e.source, e.reason, net.name))
        else:
            valid.append(net)
    default, error, reason = choose_default(valid, invalid, conf_dir, pinned, fallback)
    if default is not None and default not in valid:
        valid.append(default)  # the fallback
    return Scan(tuple(valid), tuple(invalid), default, error, refused, reason)


def choose_default(
    valid: list[NetworkConfigList], invalid: list[InvalidNetwork], conf_dir: str, pinned: str,
    fallback: NetworkConfigList | None,
) -> tuple[NetworkConfigList | None, str, str]:
    """The default network (pinned by name, else the first valid one, else the
    fallback), or None, why there is none, and that as a reason code."""
    if pinned:
        for net in valid:
            if net.name == pinned:
                return net, "", ""
        for bad in invalid:
            if bad.name == pinned:
                return (None, f"default network {pinned} is invalid: {bad.source}: {bad.reason}",
                        DEFAULT_INVALID)
        return None, (
            f'default network {pinned} not found: expected a file in {conf_dir} '
            f'with "name": "{pinned}"'
        ), DEFAULT_NOT_FOUND
    if valid:
        return valid[0], "", ""
    if fallback is not None:
        return fallback, "", ""
    why = f"no valid CNI network configuration in {conf_dir}"
    if invalid:
        why += f" ({invalid[0].source}: {invalid[0].reason})"
    return None, why + ". Has your network provider started?", NO_NETWORK
