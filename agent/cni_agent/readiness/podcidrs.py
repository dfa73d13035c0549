"""The node's pod CIDRs: from the config, or set at run time and kept across restarts.

They reach plugins as the `ipRanges` capability (one range set per CIDR)
whenever a call supplies none — what kubelet's POD_CIDR_CHANGE is for.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
from collections.abc import Sequence
from typing import Any

from cni_agent.cni.cache import atomic_write
from cni_agent.cni.errors import InvalidArgument

MAX_CIDRS = 16


def normalize(cidrs: Sequence[str]) -> tuple[str, ...]:
    if len(cidrs) > MAX_CIDRS:
        raise InvalidArgument("cidrs", f"more than {MAX_CIDRS} CIDRs")
    out = []
    for c in cidrs:
        try:
            out.append(str(ipaddress.ip_network(c, strict=False)))
        except (ValueError, TypeError):
            raise InvalidArgument("cidrs", f"{str(c)[:60]!r} is not a CIDR") from None
    return tuple(out)


class PodCIDRs:
    def __init__(self, state_dir: str, configured: Sequence[str] = ()) -> None:
        self.path = os.path.join(state_dir, "pod-cidrs.json")
        self._cidrs = tuple(configured)
        try:
            with open(self.path, encoding="utf-8") as f:
                saved = json.load(f)
            self._cidrs = normalize(saved["cidrs"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, InvalidArgument):
            pass  # an unreadable file must not stop the agent; the config's value stands

    @property
    def cidrs(self) -> tuple[str, ...]:
        return self._cidrs

    def ranges(self) -> list[list[dict[str, Any]]]:
        return [[{"subnet": c}] for c in self._cidrs]

    async def set(self, cidrs: Sequence[str]) -> tuple[str, ...]:
        value = normalize(cidrs)
        data = json.dumps({"cidrs": list(value)}).encode()

        def save() -> None:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            atomic_write(self.path, data, 0o644)

        await asyncio.to_thread(save)
        self._cidrs = value
        return value
