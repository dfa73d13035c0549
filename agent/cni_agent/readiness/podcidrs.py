"""The node's pod CIDRs: from the config, or set at run time and kept across restarts.

They reach plugins as the `ipRanges` capability (one range set per CIDR)
whenever a call supplies none — what kubelet's POD_CIDR_CHANGE is for. A
saved value (SetPodCIDRs) overrides the config's `pod_cidrs` until
ResetPodCIDRs drops it; `source` says which of the two is in effect, and the
log says so whenever the saved value hides the config's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from cni_agent.cni.cache import atomic_write, fsync_dir
from cni_agent.cni.errors import InvalidArgument
from cni_agent.config import pod_cidrs_path, saved_pod_cidrs

log = logging.getLogger(__name__)

MAX_CIDRS = 16
SAVED = "saved"
CONFIG = "config"


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


def _text(cidrs: Sequence[str]) -> str:
    return ", ".join(cidrs) or "none"


class PodCIDRs:
    def __init__(self, state_dir: str, configured: Sequence[str] = ()) -> None:
        self.path = pod_cidrs_path(state_dir)
        self.configured = tuple(configured)
        self._saved: tuple[str, ...] | None = None
        # One change at a time: the file and the value in memory must agree.
        self._lock = asyncio.Lock()
        self._listeners: list[Callable[[], None]] = []
        try:
            self._saved = saved_pod_cidrs(state_dir)
        except (ValueError, OSError) as e:
            # An unusable file must not stop the agent; the config's value stands.
            log.warning("%s; the configured pod_cidrs are used", e)
        self._say_overridden()

    @property
    def cidrs(self) -> tuple[str, ...]:
        return self._saved if self._saved is not None else self.configured

    @property
    def source(self) -> str:
        return SAVED if self._saved is not None else CONFIG

    def ranges(self) -> list[list[dict[str, Any]]]:
        return [[{"subnet": c}] for c in self.cidrs]

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call `listener()` whenever `cidrs` or `source` changed (PropertiesChanged)."""
        self._listeners.append(listener)

    def _announce(self, before: tuple[tuple[str, ...], str]) -> None:
        if (self.cidrs, self.source) != before:
            for listener in self._listeners:
                listener()

    def _say_overridden(self) -> None:
        """The saved value hides a different configured one: never silently."""
        if self._saved is not None and self.configured and self._saved != self.configured:
            log.warning("pod CIDRs: the value SetPodCIDRs saved in %s (%s) overrides pod_cidrs "
                        "in the configuration (%s); `cni-agent pod-cidrs --reset` drops it",
                        self.path, _text(self._saved), _text(self.configured))

    def configure(self, configured: Sequence[str]) -> None:
        """A reload's `pod_cidrs`: in effect at once, unless a saved value overrides it."""
        configured = tuple(configured)
        if configured == self.configured:
            return
        before = (self.cidrs, self.source)
        self.configured = configured
        self._say_overridden()
        self._announce(before)

    async def set(self, cidrs: Sequence[str]) -> None:
        value = normalize(cidrs)
        data = json.dumps({"cidrs": list(value)}).encode()

        def save() -> None:
            os.makedirs(os.path.dirname(self.path), mode=0o755, exist_ok=True)
            atomic_write(self.path, data, 0o644)

        async with self._lock:
            await asyncio.to_thread(save)
            before = (self.cidrs, self.source)
            self._saved = value
        self._say_overridden()
        self._announce(before)

    async def reset(self) -> None:
        """Drop the saved value: the config's `pod_cidrs` are in effect again."""
        def remove() -> bool:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                return False
            fsync_dir(os.path.dirname(self.path))  # a power cut must not bring it back
            return True

        async with self._lock:
            removed = await asyncio.to_thread(remove)
            before = (self.cidrs, self.source)
            dropped, self._saved = self._saved, None
        if removed or dropped is not None:
            log.info("pod CIDRs: the saved value (%s) is dropped; the configuration's are in "
                     "effect: %s", _text(dropped or ()), _text(self.configured))
        self._announce(before)
