"""Anti-spoofing for members' attachments: which get filters, with what, and keeping them.

A member is root in its own user namespace, so it owns its pod's eth0 and can
claim any MAC and address there; on a bridge shared with root's pods that
takes their traffic (issue 44). Every attachment of a caller that is not root
(of every caller with `antispoof: all`) on a network whose first plugin is
`bridge` gets source filters on its host-side veth (`node.antispoof`), made
from its own CNI result: the host veth (the interface with no `sandbox` that
is not the bridge), the pod interface's MAC and its addresses.

- installed by the journal right after the ADD chain, before the attachment
  is ready and before the call is answered; a filter that cannot be installed
  fails the ADD (AntispoofFailed), which the caller's rollback undoes;
- removed after a successful DEL, once the host veth is gone (a DEL that ran
  without the namespace leaves the veth, and the filter stays with it);
- checked by every CHECK pass (`reconcile`): a missing or altered filter is
  drift, re-installed at once; filters of ports nothing records and whose
  veth is gone are removed.

Where a network cannot be filtered (another first plugin; nftables missing),
`Policy.spoofing` refuses it to callers that are not root unless the admin
lists it in `access.unprotected_networks`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cni_agent.cni.config import NetworkConfigList
from cni_agent.cni.errors import CNIError
from cni_agent.node.antispoof import (
    CHAIN_PREFIX,
    FilterError,
    Filters,
    NftablesUnavailable,
    PortFilter,
)
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord

log = logging.getLogger(__name__)

MODES = ("members", "all")
FILTERED_PLUGIN = "bridge"
DEFAULT_BRIDGE = "cni0"  # the bridge plugin's default `bridge`


class AntispoofFailed(CNIError):
    """An attachment's filters could not be installed: the ADD is undone."""


@dataclass
class Reconciled:
    """What one presence check found and did."""

    restored: list[tuple[str, Attachment, str]] = field(default_factory=list)  # sid, att, why
    removed: list[str] = field(default_factory=list)  # ports nothing records, veth gone
    errors: list[str] = field(default_factory=list)


def unfilterable(net: NetworkConfigList) -> str:
    """Why the agent cannot filter spoofing on `net` ("" when it can)."""
    first = net.plugins[0].type if net.plugins else ""
    if first != FILTERED_PLUGIN:
        return (f"its first plugin is {first!r}, and the agent filters spoofing only on the "
                "ports of a bridge plugin's bridge")
    return ""


def _dhcp(net: NetworkConfigList) -> bool:
    ipam = net.plugins[0].raw.get("ipam") if net.plugins else None
    return isinstance(ipam, Mapping) and ipam.get("type") == "dhcp"


def port_filter(att: Attachment, net: NetworkConfigList, result: Mapping[str, Any]) -> PortFilter:
    """The filter of one bridge attachment, from its CNI result; AntispoofFailed
    when the result does not say which veth, MAC and addresses are the pod's."""
    where = f"{att.network}/{att.ifname}"
    bridge = str(net.plugins[0].raw.get("bridge") or DEFAULT_BRIDGE)
    ifaces = [i for i in result.get("interfaces") or () if isinstance(i, Mapping)]
    # A pod interface is one with a `sandbox` key, even "": the label a member
    # may give its namespace replaces the path (cni.result.with_sandbox).
    pod = [n for n, i in enumerate(ifaces) if i.get("name") == att.ifname and "sandbox" in i]
    hosts = [str(i.get("name")) for i in ifaces
             if "sandbox" not in i and i.get("name") and i.get("name") != bridge]
    if len(pod) != 1 or len(hosts) != 1:
        raise AntispoofFailed(f"{where}: its result does not name one pod interface and one "
                              "host-side veth, so no anti-spoofing filter can be made for it")
    mac = str(ifaces[pod[0]].get("mac") or "")
    addresses = [str(ip["address"]) for ip in result.get("ips") or ()
                 if isinstance(ip, Mapping) and ip.get("address")
                 and ip.get("interface", pod[0]) == pod[0]]
    try:
        return PortFilter.of(hosts[0], mac, addresses, dhcp=_dhcp(net))
    except ValueError as e:
        raise AntispoofFailed(f"{where}: no anti-spoofing filter can be made from its result: "
                              f"{e}") from None


def _link_exists(name: str) -> bool:
    """Whether the host (the agent's namespace) has an interface of this name."""
    return os.path.exists(os.path.join("/sys/class/net", name))


class Guard:
    def __init__(self, filters: Filters | None, mode: str = "members") -> None:
        if mode not in MODES:
            raise ValueError(f"antispoof mode {mode!r} is not one of {', '.join(MODES)}")
        self.filters = filters
        self.mode = mode
        self._unavailable: str | None = None  # None: not probed yet; "": available
        # The ports filtered as far as this run knows (installed by `added`, or
        # expected by the last presence check): when the last goes, so does the
        # nftables context, at once rather than at the next pass.
        self._ports: set[str] = set()

    async def unavailable(self) -> str:
        """Why no filter can be installed on this node ("" when they can);
        asked of nftables once, and again after `reprobe`."""
        if self._unavailable is None:
            if self.filters is None:
                self._unavailable = "the agent was built without nftables filters"
            else:
                try:
                    await self.filters.probe()
                    self._unavailable = ""
                except NftablesUnavailable as e:
                    self._unavailable = str(e)
                    log.warning("anti-spoofing filters are unavailable: %s; callers that are "
                                "not root get only access.unprotected_networks", e)
        return self._unavailable

    def reprobe(self, mode: str | None = None) -> None:
        """A reload: the mode may change, and nftables may have been installed."""
        if mode is not None:
            self.mode = mode
        if self._unavailable:
            self._unavailable = None

    async def why_unprotected(self, net: NetworkConfigList) -> str:
        """Why an attachment to `net` would go unfiltered ("" when it would be)."""
        why = unfilterable(net)
        if why:
            return why
        missing = await self.unavailable()
        return f"nftables is not available on this node: {missing}" if missing else ""

    def wanted(self, owner: int, net: NetworkConfigList) -> bool:
        """Whether an attachment of `owner`'s to `net` is to be filtered."""
        return (owner != 0 or self.mode == "all") and not unfilterable(net)

    # --- the journal's hooks ----------------------------------------------------------

    async def added(self, rec: SandboxRecord, att: Attachment, net: NetworkConfigList,
                    result: Mapping[str, Any]) -> None:
        """Right after `att`'s ADD chain: its filters, or AntispoofFailed."""
        if not self.wanted(rec.owner, net):
            return
        missing = await self.unavailable()
        if missing:
            # Policy.spoofing let it through: root, or a network the admin
            # listed in access.unprotected_networks.
            log.warning("sandbox %s: %s/%s is not filtered against spoofing: %s",
                        rec.sandbox_id, att.network, att.ifname, missing)
            return
        f = port_filter(att, net, result)
        assert self.filters is not None
        self._ports.add(f.port)  # before: a failed install may have left part of it
        try:
            await self.filters.install(f)
        except FilterError as e:
            raise AntispoofFailed(f"{att.network}/{att.ifname}: nftables refused its "
                                  f"anti-spoofing filter on {f.port}: {e}") from e
        log.debug("sandbox %s: %s/%s filtered on %s (MAC %s, %s)", rec.sandbox_id, att.network,
                  att.ifname, f.port, f.mac, ", ".join((*f.ipv4, *f.ipv6)) or "no address")

    async def deleted(self, sandbox_id: str, owner: int, att: Attachment,
                      net: NetworkConfigList, result: Mapping[str, Any] | None) -> None:
        """After `att` (`owner`'s) was DELeted: its filter goes, once its veth
        is gone. Nothing to do (no nftables call) for an attachment that was
        not filtered: root's DELs cost nothing more. A failure is logged: the
        next presence check removes it."""
        if self.filters is None or not result or self._unavailable or \
                not self.wanted(owner, net):
            return
        try:
            f = port_filter(att, net, result)
        except AntispoofFailed:
            return  # nothing could have been installed for it
        if _link_exists(f.port):
            log.info("sandbox %s: %s/%s deleted, but its veth %s is still there: its "
                     "anti-spoofing filter stays until it goes", sandbox_id, att.network,
                     att.ifname, f.port)
            return
        try:
            await self.filters.remove(f.port)
        except FilterError as e:
            log.warning("sandbox %s: the anti-spoofing filter of %s stays (the next CHECK pass "
                        "removes it): %s", sandbox_id, f.port, e)
            return
        self._ports.discard(f.port)
        if not self._ports:
            await self.idle()

    # --- the presence check -------------------------------------------------------------

    async def reconcile(self, records: Sequence[SandboxRecord],
                        config_for: Callable[[Attachment], NetworkConfigList],
                        current: Callable[[str], SandboxRecord | None]) -> Reconciled:
        """One listing of the table against every ready attachment that should
        be filtered: each missing or altered filter re-installed (drift), each
        filter of a port nothing records and whose veth is gone removed.

        `config_for(att)`: the network list the attachment was added with;
        `current(sandbox_id)`: its record now (a filter is re-installed only
        while its attachment is still ready)."""
        report = Reconciled()
        if self.filters is None or await self.unavailable():
            return report
        try:
            installed = await self.filters.installed()
        except FilterError as e:
            report.errors.append(f"anti-spoofing filters not checked: {e}")
            return report
        expected: dict[str, tuple[str, Attachment, PortFilter]] = {}
        for rec in records:
            if rec.owner == 0 and self.mode != "all":
                continue  # root's: never filtered (no network config read for them)
            for att in rec.attachments:
                if att.phase is not Phase.READY or att.lost is not None or not att.result:
                    continue
                try:
                    net = config_for(att)
                    if not self.wanted(rec.owner, net):
                        continue
                    f = port_filter(att, net, att.result)
                except CNIError as e:
                    report.errors.append(f"sandbox {rec.sandbox_id}: {e}")
                    continue
                expected[f.port] = (rec.sandbox_id, att, f)
        for port, (sid, att, f) in sorted(expected.items()):
            if installed.complete(f):
                continue
            now = current(sid)
            still = now.attachment(att.ifname) if now is not None else None
            if still is None or still.phase is not Phase.READY or still.result != att.result:
                continue  # torn down or re-created meanwhile: not ours to restore
            why = "missing" if port not in installed.ports else "altered"
            try:
                await self.filters.install(f)
            except FilterError as e:
                report.errors.append(f"sandbox {sid}: the anti-spoofing filter of {port} is "
                                     f"{why} and cannot be restored: {e}")
                continue
            report.restored.append((sid, att, why))
            log.warning("sandbox %s: %s/%s: its anti-spoofing filter on %s was %s (an "
                        "nftables flush or reload?); restored", sid, att.network, att.ifname,
                        port, why)
        for port in sorted(set(installed.ports) | {c[len(CHAIN_PREFIX):] for c in installed.comments
                                                    if c.startswith(CHAIN_PREFIX)}):
            if port in expected or _link_exists(port):
                continue
            try:
                await self.filters.remove(port)
                report.removed.append(port)
            except FilterError as e:
                report.errors.append(f"the stale anti-spoofing filter of {port} stays: {e}")
        self._ports = set(expected)
        if not expected and not report.errors:
            await self.idle()
        return report

    async def idle(self) -> None:
        """Nothing is filtered: nothing to keep an nftables context (and its cache) for."""
        if self.filters is not None:
            await self.filters.idle()

    def close(self) -> None:
        if self.filters is not None:
            self.filters.close()
