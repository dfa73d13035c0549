"""`cni-agent sandbox up|down NAME`: a named network namespace on CNI networks.

What `cni-sandbox@NAME.service` runs, so that any systemd unit can live on a
CNI network without a container runtime (`NetworkNamespacePath=/run/netns/NAME`).
`up` creates the namespace with `ip netns add` (which also sets the mount
propagation that makes it visible to units with their own mount namespace),
waits for readiness, bounded, and sets up sandbox NAME in it with the options
of `SANDBOX_DIR/NAME.yaml` (the default network when there is none); on any
failure it deletes the namespace it created. `down` tears the sandbox down
and deletes the namespace. Both may be repeated.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from cni_agent.cli.client import AgentClient, ClientError, SetupOptions
from cni_agent.cli.exits import EXIT_NOT_READY

NETNS_DIR = "/run/netns"
SANDBOX_DIR = "/etc/cni-agent/sandboxes"
DEFAULT_TIMEOUT = 60.0
# A netns file name and a systemd instance name that needs no escaping.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_KEYS = ("networks", "args", "capabilities")


class SpecError(ClientError):
    """NAME or its YAML file is unusable: a usage error (exit 2)."""

    def __init__(self, message: str) -> None:
        super().__init__("invalid sandbox", message)


@dataclass(frozen=True)
class SandboxSpec:
    networks: tuple[tuple[str, str], ...] = ()
    args: tuple[tuple[str, str], ...] = ()
    capabilities: str | None = None

    def options(self) -> SetupOptions:
        return SetupOptions(self.networks, self.args, None, self.capabilities)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise SpecError(f"{name!r} is not a sandbox name (letters, digits, '_', '.', '-'; "
                        "at most 63; not starting with a punctuation mark)")
    return name


def split_network(value: str) -> tuple[str, str]:
    """NAME or NAME:IFNAME (the CLI's --network and a sandbox file's networks)."""
    name, colon, ifname = value.partition(":")
    if not name or (colon and not ifname) or ":" in ifname:
        raise ValueError(f"{value!r} is not NAME or NAME:IFNAME")
    return name, ifname


def _network(source: str, i: int, item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        try:
            return split_network(item)
        except ValueError as e:
            raise SpecError(f"{source}: networks[{i}]: {e}") from None
    elif isinstance(item, Mapping) and set(item) <= {"name", "ifname"}:
        name, ifname = item.get("name", ""), item.get("ifname", "")
    else:
        raise SpecError(f"{source}: networks[{i}]: must be NAME, NAME:IFNAME or "
                        "{name: NAME, ifname: IFNAME}")
    if not isinstance(name, str) or not name or not isinstance(ifname, str):
        raise SpecError(f"{source}: networks[{i}]: needs a network name")
    return name, ifname


def parse_spec(source: str, text: str) -> SandboxSpec:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    if doc is None:
        return SandboxSpec()
    if not isinstance(doc, Mapping):
        raise SpecError(f"{source}: the top level must be a mapping with {', '.join(_KEYS)}")
    for key in doc:
        if key not in _KEYS:
            raise SpecError(f"{source}: {key}: unknown key (known: {', '.join(_KEYS)})")
    networks = doc.get("networks") or []
    if not isinstance(networks, list):
        raise SpecError(f"{source}: networks: must be a list")
    args = doc.get("args") or {}
    if not isinstance(args, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int | bool) for k, v in args.items()):
        raise SpecError(f"{source}: args: must be a mapping of names to strings")
    caps = doc.get("capabilities")
    if caps is not None and not isinstance(caps, Mapping):
        raise SpecError(f"{source}: capabilities: must be a mapping")
    return SandboxSpec(
        tuple(_network(source, i, n) for i, n in enumerate(networks)),
        tuple((k, str(v).lower() if isinstance(v, bool) else str(v)) for k, v in args.items()),
        json.dumps(caps) if caps is not None else None,
    )


def load_spec(directory: str, name: str) -> SandboxSpec:
    path = os.path.join(directory, f"{name}.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            return parse_spec(path, f.read())
    except FileNotFoundError:
        return SandboxSpec()
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror}") from None


def _ip(*args: str) -> None:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        out = subprocess.run([ip, "netns", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClientError("netns failed", f"ip netns {' '.join(args)}: {e}") from None
    if out.returncode != 0:
        raise ClientError("netns failed", f"ip netns {' '.join(args)}: {out.stderr.strip()}")


async def up(client: AgentClient, name: str, spec: SandboxSpec, timeout: float) -> str:
    """Set sandbox `name` up in /run/netns/`name`; returns the namespace's path."""
    path = os.path.join(NETNS_DIR, check_name(name))
    created = not await asyncio.to_thread(os.path.exists, path)
    if created:
        await asyncio.to_thread(_ip, "add", name)
    try:
        if not await client.wait_ready(timeout):
            status = await client.status()
            raise ClientError("not ready", f"the network is not ready after {timeout:g}s: "
                              f"{status.last_error or status.status}", status=EXIT_NOT_READY)
        await client.setup(name, path, spec.options())
    except BaseException:
        if created:
            # Nothing may be left half set up: a failed Setup rolled itself back.
            await asyncio.to_thread(_ip, "delete", name)
        raise
    return path


async def down(client: AgentClient, name: str) -> None:
    """Tear sandbox `name` down, then delete its namespace (kept if the teardown
    failed, so that it can be retried)."""
    path = os.path.join(NETNS_DIR, check_name(name))
    present = await asyncio.to_thread(os.path.exists, path)
    await client.teardown(name, path if present else "")
    if present:
        await asyncio.to_thread(_ip, "delete", name)
