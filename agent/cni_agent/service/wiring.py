"""The agent's core, assembled from its configuration: everything but D-Bus and systemd.

The daemon wraps it in adapters; tests build it with a recording executor
and drive it in-process.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from cni_agent.cni.exec import Executor, ProcessExecutor
from cni_agent.cni.runtime import CNIRuntime, Timeouts
from cni_agent.config import AgentConfig
from cni_agent.node.antispoof import TABLE, Filters
from cni_agent.node.blocking import PathWorker
from cni_agent.node.locks import NetworkLocks, SandboxLocks
from cni_agent.readiness.fallback import fallback_network
from cni_agent.readiness.monitor import Monitor
from cni_agent.readiness.podcidrs import PodCIDRs
from cni_agent.sandboxes.attach import Attachments
from cni_agent.sandboxes.checks import Checks
from cni_agent.sandboxes.drift import DriftPasses
from cni_agent.sandboxes.gc import Reaper, gc_verb_allowed
from cni_agent.sandboxes.journal import Journal
from cni_agent.sandboxes.manager import SandboxManager
from cni_agent.sandboxes.manager import Timeouts as SandboxTimeouts
from cni_agent.sandboxes.policy import Policy
from cni_agent.sandboxes.spoofguard import Guard
from cni_agent.sandboxes.store import SandboxStore
from cni_agent.service.cnicall import ShimCalls
from cni_agent.service.metrics import Metrics
from cni_agent.service.queued import QueuedTeardowns
from cni_agent.service.tracing import Tracing


def policy_of(cfg: AgentConfig) -> Policy:
    """`access.*`: what callers that are not root may use."""
    a = cfg.access
    return Policy.of(a.networks, a.capabilities, a.max_sandboxes,
                     max_attachments=a.max_attachments, members_share=a.members_share,
                     host_ports=a.port_ranges(), cni_args=a.cni_args,
                     unprotected_networks=a.unprotected_networks)


DEFAULT_STATE_DIR = "/var/lib/cni-agent"


def antispoof_table(cfg: AgentConfig) -> str:
    """The agent's nftables table: `cni_agent`, or one of its own for an agent
    with another state_dir (each agent reconciles its table with its own
    records; tests run many at once)."""
    state = os.path.realpath(cfg.state_dir)
    if state == DEFAULT_STATE_DIR:
        return TABLE
    return f"{TABLE}_{hashlib.sha256(state.encode()).hexdigest()[:10]}"


def instance_of(cfg: AgentConfig) -> str:
    """What marks this agent's plugin processes (see `exec.kill_leftovers`)."""
    return os.path.realpath(cfg.state_dir)


@dataclass
class Core:
    runtime: CNIRuntime
    monitor: Monitor
    journal: Journal
    locks: SandboxLocks
    reaper: Reaper
    pod_cidrs: PodCIDRs
    manager: SandboxManager
    attachments: Attachments
    shim: ShimCalls
    metrics: Metrics
    checks: Checks
    drift: DriftPasses
    queued: QueuedTeardowns
    tracing: Tracing

    async def stop(self) -> None:
        await self.queued.stop()
        await self.monitor.stop()
        await self.drift.stop()
        await self.reaper.stop()
        self.journal.paths.stop()
        self.journal.guard.close()
        await self.journal.store.close()
        await self.tracing.close()


def build_core(cfg: AgentConfig, executor: Executor | None = None) -> Core:
    t = cfg.timeouts
    metrics = Metrics()
    runtime = CNIRuntime(
        cfg.plugin_dirs, cfg.state_dir,
        executor=metrics.observe(executor or ProcessExecutor(instance=instance_of(cfg),
                                                             subreaper=True)),
        timeouts=Timeouts(add=t.add, delete=t.delete, check=t.check, status=t.status,
                          gc=t.gc, version=t.version),
    )
    reaper: Reaper | None = None

    async def gc_on_ready() -> None:
        assert reaper is not None
        await reaper.collect()

    monitor = Monitor(
        runtime, cfg.conf_dir,
        default_network=cfg.default_network,
        fallback=fallback_network(cfg.state_dir) if cfg.fallback_network else None,
        startup_interval=cfg.monitor.startup_interval,
        interval=cfg.monitor.interval,
        grace_period=cfg.monitor.grace_period,
        on_ready=gc_on_ready,
    )
    monitor.subscribe(metrics.on_state)
    netlocks = NetworkLocks()
    journal = Journal(runtime, SandboxStore(cfg.state_dir), netlocks,
                      current=monitor.network, lock_timeout=t.lock, paths=PathWorker(),
                      guard=Guard(Filters(antispoof_table(cfg)), cfg.antispoof))
    locks = SandboxLocks(os.path.join(cfg.runtime_dir, "locks"), observe=metrics.locked)
    reaper = Reaper(journal, locks, netlocks, monitor.networks,
                    gc_verb=gc_verb_allowed(cfg.gc.networks), lock_timeout=t.lock,
                    verb_wait=min(t.lock, 10.0), interval=cfg.gc.interval,
                    on_report=lambda r: metrics.gc_report(len(r.deleted), len(r.rolled_back)),
                    on_pass=lambda r: metrics.reaping_pass(bool(r.deleted or r.rolled_back)))
    pod_cidrs = PodCIDRs(cfg.state_dir, cfg.pod_cidrs)
    # A lost attachment's first retry: 30 s, or one check.interval when shorter.
    retry = min(30.0, cfg.check.interval) if cfg.check.interval > 0 else 30.0
    checks = Checks(journal, repair=cfg.check.repair, new_address=cfg.check.repair_new_address,
                    retry_base=retry)
    checks.subscribe(metrics.check)
    manager = SandboxManager(journal, monitor, locks, reaper, pod_cidrs,
                             SandboxTimeouts(lock=t.lock, ready=t.ready), checks, policy_of(cfg))
    drift = DriftPasses(manager, interval=cfg.check.interval,
                        concurrency=cfg.check.concurrency)
    manager.on_set_up = drift.baseline
    attachments = Attachments(manager)
    tracing = Tracing.from_config(cfg.tracing)
    shim = ShimCalls(attachments, monitor, on_call=metrics.shim_call, first_verdict=t.status,
                     tracing=tracing)
    queued = QueuedTeardowns(shim, journal.store, manager, on_outcome=metrics.queued_teardown)
    return Core(runtime, monitor, journal, locks, reaper, pod_cidrs, manager, attachments, shim,
                metrics, checks, drift, queued, tracing)
