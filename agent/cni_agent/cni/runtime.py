"""Chains of plugins over a network configuration list (libcni's shape).

One public method per verb; each loops over `_run` for its plugins. Version
gates live here, once each. ADD, DEL and CHECK run under one deadline per
chain (`ChainDeadline`); STATUS, GC and VERSION time each plugin.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cni_agent.cni import tracectx
from cni_agent.cni.args import format_cni_args
from cni_agent.cni.cache import CachedAttachment, ResultCache
from cni_agent.cni.config import SHIM_TYPE, NetworkConfigList, PluginConf, parse_list_or_none
from cni_agent.cni.errors import (
    CacheError,
    CNIError,
    ConfigError,
    EntryKept,
    ExecError,
    NoCachedResult,
    PluginBadOutput,
    PluginError,
    PluginNotFound,
    PluginTimeout,
    PluginUnsafe,
)
from cni_agent.cni.exec import (
    Executor,
    Invocation,
    ProcessExecutor,
    decode_json,
)
from cni_agent.cni.logctx import log_fields
from cni_agent.cni.result import convert_result, parse_result, version_at_least, with_sandbox
from cni_agent.cni.trust import PluginPath, check_plugin_dirs

log = logging.getLogger(__name__)
# Verbs whose failure is an expected answer, not an incident.
_QUIET_FAILURES = frozenset({"STATUS", "VERSION"})

VALID_ATTACHMENTS_KEY = "cni.dev/valid-attachments"
LEGACY_ATTACHMENTS_KEY = "cni.dev/attachments"


@dataclass(frozen=True)
class Timeouts:
    """Seconds allowed per verb; every plugin execution has a timeout.

    `add`, `delete` and `check` bound a whole chain: one deadline, each plugin
    getting what is left of it. A DEL is a chain of its own, so the rollback of
    an ADD that ran out of time gets its full `delete`. `status`, `gc` and
    `version` bound each plugin execution (GC goes on past a failed plugin).
    """

    add: float = 120.0
    delete: float = 60.0
    check: float = 30.0
    status: float = 10.0
    gc: float = 60.0
    version: float = 10.0


# The configuration key of each chain-bounded verb, for messages.
_CHAIN_KEYS = {"ADD": "timeouts.add", "DEL": "timeouts.del", "CHECK": "timeouts.check"}


@dataclass(frozen=True)
class ChainDeadline:
    """One deadline for a whole ADD, DEL or CHECK chain (monotonic clock).

    Each plugin runs with the time left as its timeout (the executor kills its
    process group when it runs out); a plugin due when none is left fails at
    once, as a timeout, without being started.
    """

    verb: str
    network: str
    budget: float  # seconds for the whole chain
    ends: float  # time.monotonic() when it runs out

    @classmethod
    def starting(cls, verb: str, network: str, budget: float,
                 now: float | None = None) -> ChainDeadline:
        return cls(verb, network, budget, (time.monotonic() if now is None else now) + budget)

    def left(self, now: float | None = None) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.ends - (time.monotonic() if now is None else now))

    def timed_out(self, plugin: str, given: float) -> PluginTimeout:
        """The error of `plugin`, killed after `given` seconds (0: never started)."""
        chain = (f"the {self.verb} chain of network {self.network} ran out of its "
                 f"{self.budget:g}s ({_CHAIN_KEYS.get(self.verb, 'timeouts')})")
        if given <= 0:
            return PluginTimeout(plugin, self.verb, 0.0, what=f"not started: {chain}")
        # To 10 ms: the chain's first plugin gets its whole budget less the
        # moments before it started, which "0.999s" would only make look odd.
        return PluginTimeout(plugin, self.verb, given,
                             what=f"timed out after {round(given, 2):g}s (process group killed): "
                                  f"{chain}")


@dataclass(frozen=True)
class RuntimeConf:
    """What a caller supplies for one attachment."""

    container_id: str
    netns: str
    ifname: str
    args: tuple[tuple[str, str], ...] = ()
    capability_args: Mapping[str, Any] = field(default_factory=dict)
    # The caller's path when `netns` (CNI_NETNS) is the agent's pinned handle of
    # it: the cache and the result keep the caller's. None: `netns` itself.
    given_netns: str | None = None

    @classmethod
    def from_cache(cls, entry: CachedAttachment, netns: str | None = None) -> RuntimeConf:
        return cls(
            container_id=entry.container_id,
            netns=entry.netns if netns is None else netns,
            ifname=entry.ifname,
            args=entry.cni_args,
            capability_args=dict(entry.capability_args),
        )


def plugin_stdin(
    net: NetworkConfigList,
    plugin: PluginConf,
    prev_result: Mapping[str, Any] | None = None,
    capability_args: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """The JSON a plugin reads: its own config with the list's name/version injected.

    A static `runtimeConfig` in the config is kept, as libcni does; the caller's
    capability args that the plugin declares are merged in over it. STATUS and
    GC pass neither a prevResult nor capabilities, GC adds `extra`.
    """
    conf = dict(plugin.raw)
    conf["name"] = net.name
    conf["cniVersion"] = net.cni_version
    conf.pop("prevResult", None)
    if prev_result is not None:
        conf["prevResult"] = dict(prev_result)
    injected = {
        k: v for k, v in (capability_args or {}).items() if k in plugin.capabilities
    }
    if injected:
        static = conf.get("runtimeConfig")
        conf["runtimeConfig"] = {**(static if isinstance(static, dict) else {}), **injected}
    conf.update(extra or {})
    return json.dumps(conf).encode()


class CNIRuntime:
    def __init__(
        self,
        plugin_dirs: Sequence[str],
        state_dir: str,
        *,
        executor: Executor | None = None,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.plugin_dirs = tuple(plugin_dirs)  # as configured (and watched)
        self.cache = ResultCache(state_dir)
        self.executor: Executor = executor or ProcessExecutor()
        self.timeouts = timeouts or Timeouts()
        # VERSION answers keyed by the binary's identity, so rescans are cheap.
        self._versions: dict[tuple[str, int, int, int, int], tuple[str, ...]] = {}
        self.plugin_path = PluginPath()
        self.refresh_plugin_path()

    def refresh_plugin_path(self) -> PluginPath:
        """Re-check the plugin dirs (blocking, cheap); logs what changed.

        Only trusted dirs are searched and go into CNI_PATH: a delegating
        plugin (bridge → host-local) looks there, out of the agent's sight.
        """
        new = check_plugin_dirs(self.plugin_dirs)
        old, self.plugin_path = self.plugin_path, new
        was = dict(old.untrusted)
        for d, why in new.untrusted:
            if was.get(d) != why:
                log.warning("plugin directory %s left out of CNI_PATH: %s", d, why)
        for d in new.trusted:
            if d in was:
                log.info("plugin directory %s is trusted again", d)
        return new

    @property
    def cni_path(self) -> str:
        return self.plugin_path.cni_path

    def find(self, plugin: str, verb: str = "lookup") -> str:
        path = self.plugin_path
        try:
            return self.executor.find(plugin, path.trusted, verb)
        except PluginNotFound:
            # Say so when the binary is there, but only in a dir we refuse.
            if "/" not in plugin and plugin not in ("", ".", ".."):
                for d, why in path.untrusted:
                    if os.path.isfile(os.path.join(d, plugin)):
                        raise PluginUnsafe(plugin, verb, f"refusing to run {os.path.join(d, plugin)}: "
                                           f"{why}") from None
            raise

    async def _run(
        self, net: NetworkConfigList, plugin: PluginConf, inv: Invocation, stdin: bytes,
        timeout: float | ChainDeadline,
    ) -> bytes:
        """One plugin execution: `timeout` seconds, or what is left of its chain's
        deadline; with the call's trace context, when it has one (`tracectx`)."""
        call = tracectx.current()
        if call is None:
            return await self._exec(net, plugin, inv, stdin, timeout)
        with call.plugin(inv, plugin.type, net.name) as traced:
            return await self._exec(net, plugin, traced, stdin, timeout)

    async def _exec(
        self, net: NetworkConfigList, plugin: PluginConf, inv: Invocation, stdin: bytes,
        timeout: float | ChainDeadline,
    ) -> bytes:
        with log_fields(CNI_COMMAND=inv.command, PLUGIN=plugin.type, NETWORK=net.name,
                        IFNAME=inv.ifname, SANDBOX_ID=inv.container_id):
            try:
                binary = self.find(plugin.type, inv.command)
                if not isinstance(timeout, ChainDeadline):
                    log.debug("running %s %s of %s", plugin.type, inv.command, net.name)
                    return await self.executor.execute(plugin.type, binary, inv, stdin, timeout)
                left = timeout.left()
                if left <= 0:
                    raise timeout.timed_out(plugin.type, 0.0)
                log.debug("running %s %s of %s (%.3gs left of its chain's %gs)", plugin.type,
                          inv.command, net.name, left, timeout.budget)
                try:
                    return await self.executor.execute(plugin.type, binary, inv, stdin, left)
                except PluginTimeout as e:
                    raise timeout.timed_out(plugin.type, e.timeout) from None
            except CNIError as e:
                # A failing STATUS is how "not ready" looks: the monitor reports it.
                level = logging.DEBUG if inv.command in _QUIET_FAILURES else logging.WARNING
                log.log(level, "%s %s of %s failed: %s", plugin.type, inv.command, net.name, e)
                raise

    def _invocation(self, command: str, rt: RuntimeConf | None = None) -> Invocation:
        if rt is None:
            return Invocation(command=command, path=self.cni_path)
        return Invocation(
            command=command,
            container_id=rt.container_id,
            netns=rt.netns,
            ifname=rt.ifname,
            args=format_cni_args(rt.args),
            path=self.cni_path,
        )

    # --- ADD ---------------------------------------------------------------

    async def add(self, net: NetworkConfigList, rt: RuntimeConf) -> dict[str, Any]:
        """Run the chain forward, all of it within `timeouts.add`, and cache the
        final result (written, not fsynced, as libcni does: a caller that needs
        it to survive a power loss keeps it too, as the journal does).

        Nothing is cached on failure; the caller must DEL (the spec requires it),
        a chain with a deadline of its own.
        """
        prev: dict[str, Any] | None = None
        inv = self._invocation("ADD", rt)
        deadline = ChainDeadline.starting("ADD", net.name, self.timeouts.add)
        for plugin in net.plugins:
            out = await self._run(
                net, plugin, inv, plugin_stdin(net, plugin, prev, rt.capability_args), deadline,
            )
            if not out.strip():
                # libcni fails here too: an empty result would replace the
                # prevResult chain and be cached as an attachment without IPs.
                raise PluginBadOutput(plugin.type, "ADD", "exited 0 but printed no result "
                                      "(a successful ADD must print one)")
            data = decode_json(plugin.type, "ADD", out)
            try:
                prev = parse_result(data, net.cni_version, owned=True)
                if prev["cniVersion"] != net.cni_version:  # else converting re-parses, to no effect
                    prev = convert_result(prev, net.cni_version)
            except CNIError as e:
                raise PluginBadOutput(plugin.type, "ADD", f"invalid result: {e}") from None
        assert prev is not None
        if rt.given_netns is not None:
            prev = with_sandbox(prev, rt.given_netns)
        entry = CachedAttachment(
            container_id=rt.container_id,
            network=net.name,
            ifname=rt.ifname,
            netns=rt.netns if rt.given_netns is None else rt.given_netns,
            config=net.bytes,
            cni_args=tuple(rt.args),
            capability_args=dict(rt.capability_args),
            result=prev,
        )
        self.cache.write(entry)  # a few syscalls: on the loop
        return prev

    # --- DEL ---------------------------------------------------------------

    def cached(self, net_name: str, container_id: str, ifname: str) -> CachedAttachment | None:
        return self.cache.read(net_name, container_id, ifname)

    async def delete(
        self, net: NetworkConfigList, rt: RuntimeConf, *, prev_result: Mapping[str, Any] | None = None,
        use_cache: bool = True,
    ) -> None:
        """Run the chain in reverse; drop the cache entry only after success.

        `prev_result` is the ADD result as cached (callers that hold the entry
        pass it; else, with `use_cache`, it is read here), converted to the
        version of `net`, which may be a newer config than the ADD's. DEL is
        sent even when the netns is gone (plugins must tolerate it).

        The one DEL policy, for rollback, Teardown, reaping and GC alike: a DEL
        that fails while the args carry keys the plugin may not know is tried
        once more with IgnoreUnknown=1. A plugin that rejected the caller's
        CNI_ARGS on ADD ("unknown args") rejects them on every DEL too, which
        would make the attachment impossible to remove; the DEL does not need
        them, and IgnoreUnknown is the spec's way to say so. Both tries share
        one `timeouts.del` deadline; a timed-out DEL is not tried again.
        """
        if use_cache and prev_result is None:
            prev_result = self._cached_result(net, rt)  # one small file: on the loop
        prev = self._prev_result(net, prev_result)
        deadline = ChainDeadline.starting("DEL", net.name, self.timeouts.delete)
        try:
            await self._delete_chain(net, rt, prev, deadline)
        except CNIError as e:
            if (isinstance(e, PluginTimeout) or not rt.args
                    or any(k == "IgnoreUnknown" for k, _ in rt.args)):
                raise
            await self._delete_chain(net, replace(rt, args=(("IgnoreUnknown", "1"), *rt.args)),
                                     prev, deadline)
        try:
            self.cache.delete(net.name, rt.container_id, rt.ifname)  # an unlink: no thread hop
        except CacheError as e:
            raise EntryKept(f"the DEL succeeded, but {e}") from e

    async def _delete_chain(self, net: NetworkConfigList, rt: RuntimeConf,
                            prev: Mapping[str, Any] | None, deadline: ChainDeadline) -> None:
        inv = self._invocation("DEL", rt)
        for plugin in reversed(net.plugins):
            await self._run(
                net, plugin, inv, plugin_stdin(net, plugin, prev, rt.capability_args), deadline,
            )

    @staticmethod
    def _prev_result(net: NetworkConfigList, result: Mapping[str, Any] | None
                     ) -> dict[str, Any] | None:
        """The cached result as `net`'s prevResult: None below 0.4.0 or if unconvertible."""
        if result is None or not version_at_least(net.cni_version, "0.4.0"):
            return None
        try:
            # Read for this one use: validated without the copy.
            return convert_result(dict(result), net.cni_version, owned=True)
        except CNIError:
            return None

    def _cached_result(self, net: NetworkConfigList, rt: RuntimeConf) -> Mapping[str, Any] | None:
        try:
            entry = self.cache.read(net.name, rt.container_id, rt.ifname)
        except CNIError:
            return None  # unreadable entry: DEL without prevResult, the entry is removed after
        return None if entry is None else entry.result

    # --- CHECK -------------------------------------------------------------

    async def check(self, net: NetworkConfigList, rt: RuntimeConf, *,
                    prev_result: Mapping[str, Any] | None = None) -> bool:
        """CHECK with the cached result (read here unless given), the whole chain
        within `timeouts.check`; False when the list does not support CHECK."""
        if not version_at_least(net.cni_version, "0.4.0") or net.disable_check:
            return False
        if prev_result is None:
            prev_result = self._cached_result(net, rt)  # one small file: on the loop
        prev = self._prev_result(net, prev_result)
        if prev is None:
            raise NoCachedResult(
                f"no cached result for {rt.container_id}/{rt.ifname} on network {net.name}")
        inv = self._invocation("CHECK", rt)
        deadline = ChainDeadline.starting("CHECK", net.name, self.timeouts.check)
        for plugin in net.plugins:
            await self._run(
                net, plugin, inv, plugin_stdin(net, plugin, prev, rt.capability_args), deadline,
            )
        return True

    # --- STATUS ------------------------------------------------------------

    async def status(self, net: NetworkConfigList) -> bool:
        """STATUS of each plugin in order; the first error is raised unchanged.

        Lists older than 1.1.0 have no STATUS: False (nothing executed), and
        the caller counts a valid list as ready.
        """
        if not version_at_least(net.cni_version, "1.1.0"):
            return False
        inv = self._invocation("STATUS")
        for plugin in net.plugins:
            await self._run(net, plugin, inv, plugin_stdin(net, plugin), self.timeouts.status)
        return True

    # --- GC ----------------------------------------------------------------

    async def gc(self, net: NetworkConfigList, valid: Iterable[tuple[str, str]]) -> tuple[str, ...]:
        """The GC verb, with the attachments that are valid; returns the errors.

        Only the verb: DELs of stale cached attachments are the caller's (each
        under its sandbox's lock), and so is excluding ADD/DEL on `net` while
        this runs. Continues past errors, so every plugin gets its GC.
        """
        if not version_at_least(net.cni_version, "1.1.0") or net.disable_gc:
            return ()
        attachments = [{"containerID": c, "ifname": i} for c, i in sorted(set(valid))]
        extra = {VALID_ATTACHMENTS_KEY: attachments, LEGACY_ATTACHMENTS_KEY: attachments}
        inv = self._invocation("GC")
        errors: list[str] = []
        for plugin in net.plugins:
            try:
                await self._run(net, plugin, inv, plugin_stdin(net, plugin, extra=extra), self.timeouts.gc)
            except CNIError as e:
                errors.append(str(e))
        return tuple(errors)

    # --- VERSION and validation -----------------------------------------------

    async def version(self, plugin: str, cni_version: str = "1.1.0") -> tuple[str, ...]:
        """The versions a plugin supports (cached per binary identity)."""
        binary = self.find(plugin, "VERSION")
        key = _binary_key(binary)
        if key is not None and key in self._versions:
            return self._versions[key]
        stdin = json.dumps({"cniVersion": cni_version}).encode()
        out = await self.executor.execute(
            plugin, binary, self._invocation("VERSION"), stdin, self.timeouts.version
        )
        data = decode_json(plugin, "VERSION", out)
        versions = data.get("supportedVersions") if isinstance(data, dict) else None
        if not isinstance(versions, list) or not all(isinstance(v, str) for v in versions):
            raise PluginBadOutput(plugin, "VERSION", "no supportedVersions list in the output")
        result = tuple(versions)
        if key is not None:
            self._versions[key] = result
        return result

    async def validate(self, net: NetworkConfigList) -> None:
        """Raise ConfigError unless every plugin exists and supports the list's version."""
        if SHIM_TYPE in net.plugin_types:
            raise ConfigError(net.source or net.name,
                              f"plugin {SHIM_TYPE} forwards to this agent, which would call itself: "
                              "the agent's networks go in its own conf_dir (for example "
                              "/etc/cni-agent/net.d), the shim's in the runtime's")
        for plugin in net.plugins:
            try:
                versions = await self.version(plugin.type)
            except (ExecError, PluginError) as e:
                raise ConfigError(net.source or net.name, str(e)) from None
            if net.cni_version not in versions:
                raise ConfigError(
                    net.source or net.name,
                    f"plugin {plugin.type} does not support cniVersion {net.cni_version} "
                    f"(it supports {', '.join(versions) or 'nothing'})",
                )


def _binary_key(binary: str) -> tuple[str, int, int, int, int] | None:
    """Identifies a binary's content cheaply; None when it cannot be stat()ed."""
    try:
        st = os.stat(binary)
    except OSError:
        return None
    return (binary, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def cached_config(entry: CachedAttachment) -> NetworkConfigList | None:
    """The list an attachment was added with (from its cache entry), if it parses."""
    return parse_list_or_none(entry.config, entry.path or entry.network)

