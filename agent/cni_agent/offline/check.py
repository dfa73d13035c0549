"""`cni-agent config check`: what the daemon would refuse or not serve, offline.

The agent's files (every layer), then every network file of `conf_dir` as
the daemon reads them (`cni.config.load_dir`: parse, cniVersion supported),
each valid network's plugins present in a trusted plugin dir (`cni.trust`)
and supporting its cniVersion (their VERSION, as the readiness monitor asks).
One line per problem, and one per warning (a key that takes no effect here:
`tracing.otlp_endpoint` without the OpenTelemetry SDK), which alone leaves
the check clean; nothing is written, no bus is needed.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from cni_agent.cni.config import NetworkConfigList, load_dir
from cni_agent.cni.errors import ConfigError
from cni_agent.cni.exec import ProcessExecutor
from cni_agent.cni.runtime import CNIRuntime, Timeouts
from cni_agent.config import AgentConfig, tracing_sdk_missing

EXIT_CLEAN, EXIT_PROBLEMS = 0, 1


@dataclass(frozen=True)
class Report:
    problems: tuple[str, ...]
    networks: tuple[str, ...]
    default: str
    # What works, but not as configured (the agent logs the same at start).
    warnings: tuple[str, ...] = ()

    def summary(self, cfg: AgentConfig) -> str:
        files = ", ".join(cfg.sources) or "no file (defaults)"
        nets = ", ".join(self.networks) or "none"
        return (f"ok: configuration from {files}; networks in {cfg.conf_dir}: {nets}; "
                f"default network: {self.default or '(built-in fallback)'}")


async def _validate(runtime: CNIRuntime, cfg: AgentConfig) -> tuple[list[str], list[str]]:
    loaded = await asyncio.to_thread(load_dir, cfg.conf_dir)
    problems = [f"{bad.source}: {bad.reason}" for bad in loaded.invalid]
    valid: list[str] = []
    for net in loaded.networks:
        try:
            await runtime.validate(net)
        except ConfigError as e:
            problems.append(f"{e.source}: {e.reason}")
        else:
            valid.append(net.name)
            problems += _unfilterable(cfg, net)
    return problems, valid


def _unfilterable(cfg: AgentConfig, net: NetworkConfigList) -> list[str]:
    """A network opened to members that the daemon would refuse them: it
    filters spoofing only on a bridge plugin's ports (sandboxes/spoofguard.py)."""
    first = net.plugins[0].type if net.plugins else ""
    a = cfg.access
    if net.name not in a.networks or net.name in a.unprotected_networks or first == "bridge":
        return []
    return [f"{net.source}: access.networks ({cfg.origin('access.networks')}) opens {net.name} "
            f"to members, but its first plugin is {first!r}, not bridge: the agent cannot "
            "filter address spoofing on it, so members are refused it unless "
            "access.unprotected_networks lists it"]


def check(cfg: AgentConfig) -> Report:
    """Every problem the daemon would report (blocking: it runs plugins' VERSION)."""
    with tempfile.TemporaryDirectory(prefix="cni-agent-check-") as scratch:
        # The runtime's state dir is never written by VERSION; a scratch one keeps
        # the check from touching the agent's.
        runtime = CNIRuntime(cfg.plugin_dirs, scratch, executor=ProcessExecutor(),
                             timeouts=Timeouts(version=cfg.timeouts.version))
        problems = [f"{d}: plugin directory refused (left out of CNI_PATH): {why}"
                    for d, why in runtime.plugin_path.untrusted]
        found, valid = asyncio.run(_validate(runtime, cfg))
    problems += found
    default = _default(cfg, valid)
    if cfg.default_network and cfg.default_network not in valid:
        problems.append(f"{cfg.conf_dir}: default_network {cfg.default_network} "
                        f"({cfg.origin('default_network')}) is not a valid network here")
    elif not default and not cfg.fallback_network:
        problems.append(f"{cfg.conf_dir}: no valid network configuration: the agent would not "
                        "become ready (fallback_network is false)")
    return Report(tuple(problems), tuple(valid), default, tuple(_warnings(cfg)))


def _warnings(cfg: AgentConfig) -> list[str]:
    """Keys that take no effect here: spans need the OpenTelemetry SDK."""
    missing = tracing_sdk_missing() if cfg.tracing.otlp_endpoint else ""
    if not missing:
        return []
    return [f"{cfg.origin('tracing.otlp_endpoint')}: warning: tracing.otlp_endpoint is set, but "
            f"{missing}; no spans are exported (plugins still get the callers' trace context)"]


def _default(cfg: AgentConfig, valid: Sequence[str]) -> str:
    if cfg.default_network:
        return cfg.default_network if cfg.default_network in valid else ""
    return valid[0] if valid else ""
