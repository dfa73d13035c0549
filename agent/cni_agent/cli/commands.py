"""The `cni-agent` command line: `run` (the daemon) and the client commands.

The client commands call `org.cniagent.Agent1` over D-Bus (`cni_agent.cli.client`)
and print with `cni_agent.cli.output`: short aligned text by default (coloured
only on a terminal, never with NO_COLOR set), JSON with `--json`. Errors are one
line on stderr, `cni-agent: MEANING: MESSAGE`. Exit status (`cni_agent.cli.exits`):
0 success, 1 the operation failed, 2 usage or configuration error, 3 not
ready or timed out waiting, 4 access denied, 5 the agent is not running.

JSON output (stable; new keys may be added, none removed or renamed):

- `status --json`: one object:
  `{"network_ready": bool, "status": str, "default_network": str,
  "networks": [str], "last_error": str, "pod_cidrs": [str],
  "pod_cidrs_source": str}` — the D-Bus properties NetworkReady, Status,
  DefaultNetwork, Networks, LastError, PodCIDRs, PodCIDRsSource.
- `monitor --json`: one object per line, the first for the state at start,
  then one per change of readiness (any property but PodCIDRs) or of the
  agent's presence: the `status` object plus `"time"` (ISO 8601, local
  time with offset, milliseconds) and `"agent_running"` (false when the agent
  left the bus; then `network_ready` is false and `last_error` is
  "agent not running").
- `events --json`: one object per line: `{"time", "sandbox", "change", "owner",
  "attachments": [{"network", "ifname", "state", "mac", "addresses"}]}` for
  each SandboxChanged (change: set-up, attached, detached, torn-down, reaped,
  lost, repaired; state: ready, gone, lost); `{"time", "sandbox", "change":
  "drifted" | "check", "network", "ifname", "state", "reason"}` for
  AttachmentDrifted and AttachmentCheckChanged; `{"time", "agent_running"}`
  when the agent leaves the bus or is back.
- `setup --json`, `show --json`: the agent's result, unchanged:
  `{"sandbox": ID, "state": STATE, "attachments": [{"network": NAME, "ifname": IF,
  "result": CNI_RESULT}]}`, each CNI result in its network's cniVersion.
- `list --json`: `{"sandboxes": [ID, ...]}`, sorted.
- `networks --json`: `{"networks": [DOC, ...]}`, one NetworkCapacity
  document per valid network, in load order: `{"network", "capacity":
  "known" | "none" | "unknown", "ipam": [TYPE], "reason"}`, and for
  "known" `"size"`, `"used"`, `"free"` and `"range_sets"` (docs/dbus-api.md).
- `pod-cidrs --json`: `{"pod_cidrs": [str], "source": "config" | "saved"}` (the
  PodCIDRs and PodCIDRsSource properties; source "" from an agent too old to say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import math
import os
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from cni_agent import __version__
from cni_agent.cli import sandbox, shim_config
from cni_agent.cli.client import AgentClient, AgentUnavailable, ClientError, SandboxResult, SetupOptions
from cni_agent.cli.exits import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_READY,
    EXIT_NOT_RUNNING,
    EXIT_OK,
    EXIT_USAGE,
)
from cni_agent.cli.output import (
    BUS_HELP,
    TOP_EPILOG,
    ManFormatter,
    change_json,
    colour_enabled,
    dumps,
    event_json,
    format_attachments,
    format_change,
    format_checks,
    format_event,
    format_networks,
    format_pod_cidrs,
    format_status,
)
from cni_agent.cli.runargs import RUN_DESCRIPTION, RUN_HELP, add_run_arguments
from cni_agent.cni.args import PodMeta, validate_network_name
from cni_agent.cni.config import SHIM_VERSIONS
from cni_agent.cni.errors import InvalidArgument

DEFAULT_WAIT = 30.0
# `cni-agent state`: one word each. The agent's LastError while it drains (readiness.monitor.STOPPED).
READY_WORD, NOT_READY_WORD, STOPPING_WORD, NOT_RUNNING_WORD = "ready", "not-ready", "stopping", "not-running"
STOPPING_ERROR = "shutting down"

ClientCommand = Callable[[AgentClient, argparse.Namespace, bool], Awaitable[int]]
# `cni-agent run`: (config path, bus) -> exit status. Given by the entry point
# (cni_agent.main), so the CLI itself never imports the daemon.
RunDaemon = Callable[[str | None, str | None], int]
# `cni-agent config show|check`: (verb, --config path, --json) -> exit status; given
# by the entry point too, since it reads the configuration (`cni_agent.offline`).
RunConfig = Callable[[str, str | None, bool], int]
# `cni-agent shim-config`: (--config path, agent network) -> (the capabilities its
# plugins declare, where they were read) or (None, why not); from the entry point too.
ReadCapabilities = Callable[[str | None, str], tuple[frozenset[str] | None, str]]
# The agent's state_dir as its configuration says (None, and why, when unreadable).
ReadStateDir = Callable[[str | None], tuple[str | None, str]]


# --- the client commands ------------------------------------------------------------


def _print_result(result: SandboxResult, as_json: bool) -> None:
    text = dumps(result.document) if as_json else format_attachments(result)
    if text:
        print(text)


async def _status(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    st = await client.status()
    print(dumps(st.to_json()) if args.json else format_status(st, colour))
    return EXIT_OK


async def _wait(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    if await client.wait_ready(args.timeout):
        return EXIT_OK
    st = await client.status()
    raise ClientError("timed out", f"network not ready after {args.timeout:g}s: "
                      f"{st.last_error or st.status}", status=EXIT_NOT_READY)


async def _state(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    st = await client.status(auto_start=False)  # a query does not start a stopped agent
    if st.network_ready:
        print(READY_WORD)
        return EXIT_OK
    print(STOPPING_WORD if st.last_error == STOPPING_ERROR else NOT_READY_WORD)
    return EXIT_NOT_READY


async def _print_changes(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    shown: tuple[object, ...] = ()
    async with contextlib.aclosing(client.watch()) as changes:
        async for st in changes:
            key = (st.network_ready, st.status, st.default_network, st.networks, st.last_error,
                   st.running)
            if key == shown:  # e.g. only PodCIDRs changed: not a readiness change
                continue
            shown, now = key, datetime.now()
            line = dumps(change_json(st, now), one_line=True) if args.json \
                else format_change(st, now, colour)
            print(line, flush=True)
    return EXIT_OK


async def _print_events(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    async with contextlib.aclosing(client.events()) as events:
        async for doc in events:
            now = datetime.now()
            print(dumps(event_json(doc, now), one_line=True) if args.json
                  else format_event(doc, now), flush=True)
    return EXIT_OK


async def _monitor(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    return await _follow(_print_changes, client, args, colour)


async def _events(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    return await _follow(_print_events, client, args, colour)


async def _follow(printer: ClientCommand, client: AgentClient, args: argparse.Namespace,
                  colour: bool) -> int:
    """Print until SIGINT/SIGTERM (exit 0, quietly) or the bus goes away (1)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher: asyncio.Task[int] = asyncio.ensure_future(printer(client, args, colour))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done():
            return watcher.result()
        return EXIT_OK
    finally:
        for task in (watcher, stopper):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _setup(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    opts = SetupOptions(tuple(args.networks), tuple(args.args), args.pod, args.capabilities)
    _print_result(await client.setup(args.id, args.netns, opts), args.json)
    return EXIT_OK


async def _teardown(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    await client.teardown(args.id, args.netns)
    return EXIT_OK


async def _detach(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    network, ifname = args.network or ("", "")
    await client.detach(args.id, args.netns, network, ifname)
    return EXIT_OK


# The check states after which an attachment may not work as set up: `check` exits 1.
NEEDS_AN_EYE = ("drifted", "lost", "failed-to-run")


async def _check(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    if args.netns:  # the contract's `check ID NETNS`: CHECK there, exit 0 if all pass
        await client.check(args.id, args.netns)
        return EXIT_OK
    rows = await client.check_sandboxes([args.id] if args.id else [])
    if args.json:
        print(dumps({"attachments": rows}))
    elif rows:
        print(format_checks(rows))
    return EXIT_FAILED if any(r.get("state") in NEEDS_AN_EYE for r in rows) else EXIT_OK


async def _show(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    _print_result(await client.show(args.id), args.json)
    return EXIT_OK


async def _list(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    ids = await client.list_sandboxes()
    if args.json:
        print(dumps({"sandboxes": ids}))
    elif ids:
        print("\n".join(ids))
    return EXIT_OK


async def _networks(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    st = await client.status()
    docs = [await client.network_capacity(name) for name in st.networks]
    print(dumps({"networks": docs}) if args.json else format_networks(docs))
    return EXIT_OK


async def _pod_cidrs(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    if args.reset:
        await client.reset_pod_cidrs()
    elif args.cidrs:
        await client.set_pod_cidrs(args.cidrs)
    st = await client.status()
    print(dumps({"pod_cidrs": list(st.pod_cidrs), "source": st.pod_cidrs_source}) if args.json
          else format_pod_cidrs(st))
    return EXIT_OK


async def _sandbox_up(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    path = await sandbox.up(client, args.name, args.spec, args.timeout)
    _print_result(await client.show(args.name), False)
    print(f"join it with NetworkNamespacePath={path}")
    return EXIT_OK


async def _sandbox_down(client: AgentClient, args: argparse.Namespace, colour: bool) -> int:
    await sandbox.down(client, args.name)
    return EXIT_OK


async def _connected(command: ClientCommand, args: argparse.Namespace, colour: bool) -> int:
    async with await AgentClient.connect(args.bus or "system") as client:
        return await command(client, args, colour)


def _run_client(command: ClientCommand, args: argparse.Namespace) -> int:
    colour = colour_enabled(sys.stdout.isatty(), os.environ)
    try:
        return asyncio.run(_connected(command, args, colour))
    except AgentUnavailable as e:
        if command is _state:  # its one word, on stdout like the others
            print(NOT_RUNNING_WORD)
            return EXIT_NOT_RUNNING
        print(f"cni-agent: {e}", file=sys.stderr)
        return e.status
    except ClientError as e:
        print(f"cni-agent: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling, or outside monitor
        return EXIT_OK if command in (_monitor, _events) else EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `cni-agent monitor | head -1`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


# --- argument types (a malformed value is a usage error: exit 2) ---------------------


def _bus(value: str) -> str:
    if value in ("system", "session") or re.fullmatch(r"[a-z-]+:.*", value):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is not system, session or a D-Bus address (like unix:path=/run/bus.sock)")


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a non-negative number of seconds")
    return seconds


def _network(value: str) -> tuple[str, str]:
    try:
        return sandbox.split_network(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _key_value(value: str) -> tuple[str, str]:
    key, eq, val = value.partition("=")
    if not key or not eq:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    return key, val


def _pod(value: str) -> PodMeta:
    parts = value.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise argparse.ArgumentTypeError(f"{value!r} is not NAMESPACE/NAME or NAMESPACE/NAME/UID")
    return PodMeta(*parts)


def _sandbox_name(value: str) -> str:
    try:
        return sandbox.check_name(value)
    except sandbox.SpecError as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a CIDR (like 10.244.1.0/24)") from None


def _no_cidrs_with_reset(args: argparse.Namespace) -> None:
    if args.reset and args.cidrs:
        raise ClientError("usage", "pod-cidrs: give CIDRs or --reset, not both")


def _capabilities(value: str) -> str:
    try:
        caps = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(caps, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"portMappings\": [...]}'")
    return value


class _AppendArg(argparse.Action):
    """--arg K=V, repeatable; the same key twice is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items: list[tuple[str, str]] = list(getattr(namespace, self.dest) or [])
        if any(k == values[0] for k, _ in items):
            parser.error(f"argument {option_string}: {values[0]} is given twice")
        setattr(namespace, self.dest, [*items, values])


# --- the parser ---------------------------------------------------------------------


def _command(sub: Any, name: str, summary: str, description: str, example: str,
             handler: ClientCommand, as_json: str = "") -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=description, epilog=f"example:\n{example}",
        formatter_class=ManFormatter)
    p.add_argument("--bus", metavar="BUS", type=_bus, default=argparse.SUPPRESS, help=BUS_HELP)
    if as_json:
        p.add_argument("--json", action="store_true",
                       help=f"print JSON for scripts: {as_json} (default: text for people)")
    p.set_defaults(client_command=handler)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cni-agent", formatter_class=ManFormatter, epilog=TOP_EPILOG,
        description="Node agent that owns CNI networking and reports network readiness on D-Bus.",
    )
    parser.add_argument("--version", action="version", version=f"cni-agent {__version__}")
    parser.add_argument("--bus", metavar="BUS", type=_bus, help=BUS_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    add_run_arguments(sub.add_parser("run", help=RUN_HELP, description=RUN_DESCRIPTION))

    p = _command(sub, "status", "show network readiness and the agent's networks", """
        Show whether the network is ready (NetworkReady), the agent's one-line Status, the
        default network, the valid networks, the node's pod CIDRs and, when not ready, why.
        Exits 0 whenever the agent answers, ready or not (5 when it is not running); use
        `cni-agent state` to test readiness.""", "  $ cni-agent status --json | jq .network_ready",
        _status, "an object with network_ready, status, default_network, networks, last_error, pod_cidrs")
    _command(sub, "state", "print one word: ready, not-ready, stopping or not-running", """
        Print the agent's state as one word: ready (exit 0), not-ready (exit 3: the network
        is not ready yet, or any more), stopping (exit 3: the agent is shutting down),
        not-running (exit 5: nothing owns org.cniagent.Agent1 on the bus, or no bus). Unlike
        the other commands it does not start a stopped agent through bus activation.""",
        "  $ [ \"$(cni-agent state)\" = ready ] || journalctl -u cni-agent", _state)
    p = _command(sub, "wait", "wait until the network is ready", """
        Wait until the agent reports NetworkReady, then exit 0; exit 3 if it is still not
        ready after the timeout (0 checks once, without waiting) or the agent stops.""",
        "  $ cni-agent wait --timeout 120 || journalctl -u cni-agent", _wait)
    p.add_argument("--timeout", metavar="SECONDS", type=_seconds, default=DEFAULT_WAIT,
                   help=f"give up after this many seconds (default: {DEFAULT_WAIT:g})")
    _command(sub, "monitor", "print each readiness change as it happens", """
        Print the current readiness as one line, then one line per change (ready or not,
        the reason, the default network, the agent leaving or coming back), each with a
        timestamp, until interrupted (Ctrl-C exits 0).""",
        "  $ cni-agent monitor\n  2026-05-09 07:35:25  ready      Ready: ...", _monitor,
        "one object per line: the status object plus time and agent_running")
    _command(sub, "events", "print each change of a sandbox as it happens", """
        Watch the sandboxes (WatchSandboxes) and print one line per change until
        interrupted (Ctrl-C exits 0): set-up, attached, detached, torn-down, reaped, lost,
        repaired, with each attachment's network, interface, state, addresses and MAC; and
        each drift and check-state change. Root sees every sandbox, another caller its own.
        When the agent restarts, the command watches again once it is back (what happened
        meanwhile is not printed).""",
        "  $ cni-agent events\n  2026-05-09 07:35:25  set-up     pod-1  podnet eth0 ready "
        "10.22.0.5/24 0a:58:0a:16:00:05", _events,
        "one object per line: time, sandbox, change, owner, attachments (network, ifname, "
        "state, mac, addresses)")
    p = _command(sub, "setup", "attach a sandbox (network namespace) to networks", """
        Run the networks' plugin chains (CNI ADD) for sandbox ID in the network namespace
        NETNS, after waiting for readiness. Repeating an identical setup returns the cached
        result. Prints one line per attachment: network, interface, addresses.""",
        "  $ cni-agent setup pod-1 /run/netns/pod-1 --network podnet --pod default/web\n"
        "  podnet  eth0  10.22.0.5/24", _setup,
        'the agent\'s result: {"sandbox": ID, "state": STATE,'
        ' "attachments": [{"network", "ifname", "result"}]}')
    p.add_argument("id", metavar="ID", help="the sandbox ID (CNI_CONTAINERID)")
    p.add_argument("netns", metavar="NETNS", help="path of the network namespace")
    p.add_argument("--network", dest="networks", metavar="NAME[:IFNAME]", type=_network,
                   action="append", default=[],
                   help="attach to this network, repeatable, in order (default: the default "
                        "network; interface eth0 for the first, net1, net2… for the others)")
    p.add_argument("--arg", dest="args", metavar="K=V", type=_key_value, action=_AppendArg,
                   default=[], help="a CNI_ARGS entry, repeatable (default: none)")
    p.add_argument("--pod", metavar="NAMESPACE/NAME[/UID]", type=_pod,
                   help="Kubernetes pod: adds K8S_POD_* args and IgnoreUnknown=1 (default: none)")
    p.add_argument("--capabilities", metavar="JSON", type=_capabilities,
                   help="runtime capabilities as a JSON object, e.g. portMappings (default: none)")
    p = _command(sub, "teardown", "detach a sandbox from all its networks", """
        Run CNI DEL for every attachment of sandbox ID and forget it. NETNS may be left out
        or already gone; tearing down an unknown sandbox succeeds. Run by a user that is not
        root, NETNS is opened with that user's rights and passed as a descriptor (the agent
        keeps none): while a process is still in the sandbox's namespace, its teardown needs
        NETNS.""",
        "  $ cni-agent teardown pod-1 /run/netns/pod-1", _teardown)
    p.add_argument("id", metavar="ID", help="the sandbox ID")
    p.add_argument("netns", metavar="NETNS", nargs="?", default="",
                   help='path of the network namespace (default: "", none)')
    p = _command(sub, "detach", "detach a sandbox from one of its networks", """
        Run CNI DEL for one attachment of sandbox ID (the default network's eth0, or the
        one --network names) and forget it; the sandbox's others stay. Nothing attached
        there succeeds. As for teardown, a user that is not root passes NETNS, opened with
        its own rights, while a process is still in the namespace.""",
        "  $ cni-agent detach pod-1 /run/netns/pod-1 --network storage:net1", _detach)
    p.add_argument("id", metavar="ID", help="the sandbox ID")
    p.add_argument("netns", metavar="NETNS", nargs="?", default="",
                   help='path of the network namespace (default: "", none)')
    p.add_argument("--network", metavar="NAME[:IFNAME]", type=_network,
                   help="the attachment (default: whichever is on eth0)")
    p = _command(sub, "check", "verify attachments (CNI CHECK) and report drift", """
        Run CNI CHECK now, as the agent's scheduled passes do, for every attachment of
        sandbox ID (of every sandbox without ID), and print each one's state: ok, drifted
        (its plugin's CHECK passed before and fails now), unsupported (its CHECK never
        passed: no evidence either way), disabled (its network allows no CHECK),
        failed-to-run (the CHECK could not run: a timeout, a plugin that could not
        start; no verdict, never repaired), lost (a repair removed it and its ADD failed;
        ADDed again with backoff), repaired-with-new-address. With check.repair a drifted
        attachment is re-created. Exits 1 if any attachment is drifted, lost or
        failed-to-run. With NETNS: CHECK sandbox ID in that namespace and exit 0 only if
        every CHECK passes (run by a user that is not root, NETNS is opened with its rights
        and passed as a descriptor).""",
        "  $ cni-agent check\n  $ cni-agent check pod-1 /run/netns/pod-1 && echo ok", _check,
        '{"attachments": [{sandbox, network, ifname, state, last_check, reason, repairs, '
        'repair, drifted_now}]}')
    p.add_argument("id", metavar="ID", nargs="?", default="",
                   help="the sandbox ID (default: every sandbox)")
    p.add_argument("netns", metavar="NETNS", nargs="?", default="",
                   help="path of the network namespace (the Check method)")
    p = _command(sub, "show", "show a sandbox's cached attachments", """
        Show the cached result of sandbox ID, one line per attachment: network, interface,
        addresses, and for an attachment that drifted (its CHECK passed before and fails
        now) the time and message of the failing CHECK; likewise for a CHECK that failed
        to run, an attachment lost by a failed repair (and its next ADD), and one a repair
        gave a new address.""",
        "  $ cni-agent show pod-1 --json | jq '.attachments[].result.ips'",
        _show, "the agent's result, as for setup --json")
    p.add_argument("id", metavar="ID", help="the sandbox ID")
    _command(sub, "list", "list the sandboxes that have cached attachments", """
        Print the ID of every sandbox with cached attachments, one per line, sorted.""",
        "  $ cni-agent list | xargs -n1 cni-agent show", _list, '{"sandboxes": [ID, ...]}')
    _command(sub, "networks", "list the networks with their address capacity", """
        Print each valid network's address pool, one line per range: its IPAM, the range,
        how many addresses it has, how many are leased and how many are free
        (NetworkCapacity). Known only where the agent can read the IPAM's own state
        (host-local: its ranges and its data dir); "none" for a network without a pool
        (static IPAM, no IPAM); "unknown" for any other IPAM (dhcp, whereabouts, a
        vendor's) or a host-local that takes its ranges with each call (ipRanges), with
        the reason: never a guess.""",
        "  $ cni-agent networks\n  NETWORK  IPAM        RANGE         SIZE  USED  FREE\n"
        "  pods     host-local  10.22.0.0/24   253    12   241", _networks,
        '{"networks": [NetworkCapacity\'s document of each network]}')
    p = _command(sub, "pod-cidrs", "show, set or reset the node's pod CIDRs", """
        Print the node's pod CIDRs (given to plugins as the ipRanges capability when a call
        gives none) and where they come from: the configuration's pod_cidrs, or a value
        saved by SetPodCIDRs (kept in state_dir across restarts), which overrides the
        configuration until it is reset. With CIDRs: save them (SetPodCIDRs). With --reset:
        drop the saved value, so the configuration's pod_cidrs are in effect again.""",
        "  $ cni-agent pod-cidrs --reset\n  Pod CIDRs: 10.244.1.0/24\n"
        "  Source:    configuration (pod_cidrs)", _pod_cidrs,
        '{"pod_cidrs": [CIDR, ...], "source": "config" or "saved"}')
    p.add_argument("cidrs", metavar="CIDR", nargs="*", type=_cidr,
                   help="save these as the node's pod CIDRs (default: change nothing)")
    p.add_argument("--reset", action="store_true",
                   help="drop the saved value: the configuration's pod_cidrs apply again")
    p.set_defaults(prepare=_no_cidrs_with_reset)
    _sandbox_commands(sub)
    _config_commands(sub)
    p = sub.add_parser(
        "shim-config", help="print a conflist that sends a runtime's CNI calls to this agent",
        formatter_class=ManFormatter, description="""
        Print a network configuration list for a container runtime's conf dir (containerd,
        CRI-O and podman read /etc/cni/net.d): its one plugin, cni-agent-shim, forwards every
        CNI call to this agent, which runs network NAME from its own conf_dir. The plugin
        declares the capabilities the plugins of NAME declare (read from conf_dir, as the
        agent reads it): a runtime passes a capability (portMappings, cgroupPath, CRI-O's
        io.kubernetes.cri.pod-annotations, ...) only to a plugin that declares it. No agent
        or bus is needed to print it.
        CRI-O's NetworkReady is its own last STATUS poll, and the agent cannot make CRI-O
        notice faster: 1.31 and older run no STATUS; 1.32-1.35 poll only until first ready;
        1.36.0-1.36.2 poll every 5 s (false 0-5 s after the agent's network fails); 1.36.3
        and later poll only when [crio.network] cni_status_grace_period is above 0, and its
        default is 0: never. --drop-in prints the file that sets it (1s: false 5-10 s after
        a failure, true again within 5 s).""",
        epilog="examples:\n  $ cni-agent shim-config --runtime containerd --network podnet --name pods"
               " > /etc/cni/net.d/10-pods.conflist\n"
               "  $ cni-agent shim-config --runtime crio --drop-in"
               f" > {shim_config.CRIO_DROP_IN}")
    p.add_argument("--network", metavar="NAME", default="", type=_network_name,
                   help="the agent network to use (default: the agent's default network)")
    p.add_argument("--name", metavar="NAME", default="", type=_network_name,
                   help="the network's name for the runtime (default: --network, else cni-agent)")
    p.add_argument("--runtime", choices=sorted(shim_config.RUNTIMES),
                   help="the runtime that reads the file: picks its cniVersion (containerd >= 2.0 and "
                        "CRI-O >= 1.32: 1.1.0, so that they send STATUS and GC; podman 4: 1.0.0) and "
                        "says on stderr where the file goes")
    p.add_argument("--cni-version", metavar="VERSION", default=None, type=_shim_version,
                   help=f"cniVersion, overriding --runtime's (without --runtime: "
                        f"{shim_config.DEFAULT_VERSION}, which every runtime reads; e.g. 1.0.0 for "
                        "containerd 1.x); one of " + ", ".join(SHIM_VERSIONS))
    p.add_argument("--config", metavar="FILE",
                   help="read the agent's configuration (its conf_dir) from FILE and FILE.d/*.yaml "
                        "instead of the layers")
    p.add_argument("--drop-in", action="store_true",
                   help=f"with --runtime crio: print the file CRI-O needs in {shim_config.CRIO_DROP_IN} "
                        "([crio.network] network_dir, plugin_dirs, cni_status_grace_period) instead")
    p.add_argument("--queue-when-down", action=argparse.BooleanOptionalAction, default=True,
                   help="while no agent runs, the shim queues a DEL in the agent's state_dir and "
                        "answers success; the agent runs it when it starts (default: on; "
                        "--no-queue-when-down: the DEL fails with code 11, and the runtime "
                        "retries)")
    p.set_defaults(func=_shim_config)
    return parser


def _state_dir(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The agent's state_dir, where the shim queues DELs (read offline, as the
    agent reads its configuration); the default, with a comment, when unknown."""
    read: ReadStateDir | None = getattr(args, "read_state_dir", None)
    state_dir, why = read(args.config) if read else (None, "this entry point reads no "
                                                           "configuration")
    if state_dir is None:
        return shim_config.DEFAULT_STATE_DIR, [
            f"warning: the agent's state_dir is unknown ({why}): the shim queues DELs in "
            f"{shim_config.DEFAULT_STATE_DIR}"]
    return state_dir, []


def _network_name(value: str) -> str:
    if not value:  # empty: the default (argparse converts string defaults too)
        return value
    try:
        return validate_network_name(value)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(e.reason) from None


def _shim_version(value: str) -> str:
    if value not in SHIM_VERSIONS:
        raise argparse.ArgumentTypeError(
            f"unsupported cniVersion {value!r} (the shim speaks {', '.join(SHIM_VERSIONS)})")
    return value


def _shim_config(args: argparse.Namespace) -> int:
    if args.drop_in:
        if args.runtime != "crio":
            print("cni-agent: shim-config: --drop-in is for --runtime crio (the only runtime "
                  "that needs one)", file=sys.stderr)
            return EXIT_USAGE
        print(shim_config.CRIO_DROP_IN_TEXT, end="")
        return EXIT_OK
    name = shim_config.runtime_name(args.network, args.name)
    version, comments = shim_config.choose(args.runtime, args.cni_version, name)
    read: ReadCapabilities | None = getattr(args, "read_capabilities", None)
    found, where = read(args.config, args.network) if read else (None, "this entry point reads no "
                                                                      "configuration")
    comments += shim_config.capability_comments(found, where)
    state_dir, notes = _state_dir(args) if args.queue_when_down else \
        (shim_config.DEFAULT_STATE_DIR, [])
    comments += notes
    # Comments on stderr: stdout stays the file itself, for `> FILE`.
    for line in comments:
        print(f"# {line}", file=sys.stderr)
    caps = shim_config.WELL_KNOWN_CAPABILITIES if found is None else found
    print(json.dumps(shim_config.conflist(args.network, args.name, version, caps,
                                          args.queue_when_down, state_dir), indent=2))
    return EXIT_OK


def _config_commands(sub: Any) -> None:
    group = sub.add_parser(
        "config", help="show or check the agent's configuration, offline",
        formatter_class=ManFormatter, description="""
        Read the configuration as the agent does, without an agent or a bus: the layers
        /usr/lib/cni-agent/agent.yaml, /etc/cni-agent/agent.yaml and the drop-ins of both
        agent.yaml.d/ (or --config FILE and FILE.d/).""")
    verbs = group.add_subparsers(dest="config_verb", metavar="VERB", title="verbs", required=True)
    show = verbs.add_parser(
        "show", help="print the merged configuration, each key with the file it came from",
        formatter_class=ManFormatter, description="""
        Print the merged configuration as YAML (it loads back as the same), each key with
        its origin as a comment: the file that set it last, or "default".""",
        epilog="example:\n  $ cni-agent config show | grep -v '# default$'")
    show.add_argument("--json", action="store_true",
                      help='print JSON for scripts: {"files", "config", "origins"} '
                           "(default: text for people)")
    check = verbs.add_parser(
        "check", help="validate the configuration and every network file, offline",
        formatter_class=ManFormatter, description="""
        Validate the agent's configuration files, and every network file in conf_dir as the
        agent would: it parses, its cniVersion is supported, its plugins are in a trusted
        plugin dir and support that version (asked with VERSION). Prints one line per
        problem. Exit status: 0 clean (one summary line), 1 problems, 2 the configuration
        itself is unusable (the agent would not start).""",
        epilog="example:\n  $ cni-agent config check && systemctl reload cni-agent")
    for p in (show, check):
        p.add_argument("--config", metavar="FILE",
                       help="read FILE and FILE.d/*.yaml instead of the layers (default: the layers)")
        p.set_defaults(config_command=True)


def _sandbox_commands(sub: Any) -> None:
    group = sub.add_parser(
        "sandbox", help="a named network namespace on CNI networks, for any process or unit",
        formatter_class=ManFormatter, description="""
        What cni-sandbox@NAME.service runs. `up` creates /run/netns/NAME, waits for
        readiness and sets sandbox NAME up in it (networks, args and capabilities from
        DIR/NAME.yaml when present, else the default network); `down` tears it down and
        deletes the namespace. Units join with NetworkNamespacePath=/run/netns/NAME.""")
    verbs = group.add_subparsers(dest="sandbox_verb", metavar="VERB", title="verbs", required=True)
    p = _command(verbs, "up", "create the namespace and set the sandbox up", """
        Create /run/netns/NAME (unless it exists), wait up to --timeout for readiness and
        set sandbox NAME up in it. On failure nothing is left: the namespace, when this
        command created it, is deleted again.""",
        "  $ cni-agent sandbox up web\n  podnet  eth0  10.22.0.5/24", _sandbox_up)
    p.add_argument("name", metavar="NAME", type=_sandbox_name,
                   help="the namespace's name, also the sandbox ID")
    p.add_argument("--timeout", metavar="SECONDS", type=_seconds,
                   default=sandbox.DEFAULT_TIMEOUT,
                   help=f"how long to wait for readiness (default: {sandbox.DEFAULT_TIMEOUT:g})")
    p.add_argument("--dir", metavar="DIR", default=sandbox.SANDBOX_DIR,
                   help=f"where NAME.yaml is looked for (default: {sandbox.SANDBOX_DIR})")
    # Read before connecting: a broken file is a usage error whether or not the agent runs.
    p.set_defaults(prepare=lambda a: setattr(a, "spec", sandbox.load_spec(a.dir, a.name)))
    p = _command(verbs, "down", "tear the sandbox down and delete the namespace", """
        Tear sandbox NAME down, then delete /run/netns/NAME. Succeeds when there is
        nothing to do; keeps the namespace when the teardown fails.""",
        "  $ cni-agent sandbox down web", _sandbox_down)
    p.add_argument("name", metavar="NAME", type=_sandbox_name,
                   help="the namespace's name, also the sandbox ID")


def main(argv: Sequence[str] | None = None, run_daemon: RunDaemon | None = None,
         run_config: RunConfig | None = None,
         read_capabilities: ReadCapabilities | None = None,
         read_state_dir: ReadStateDir | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.read_capabilities = read_capabilities
    args.read_state_dir = read_state_dir
    if getattr(args, "config_command", False):
        if run_config is None:
            print("cni-agent: config: this entry point cannot read the configuration "
                  "(use `cni-agent config`)", file=sys.stderr)
            return EXIT_USAGE
        return run_config(args.config_verb, args.config, getattr(args, "json", False))
    command: ClientCommand | None = getattr(args, "client_command", None)
    if command is not None:
        if prepare := getattr(args, "prepare", None):
            try:
                prepare(args)
            except ClientError as e:
                print(f"cni-agent: {e}", file=sys.stderr)
                return EXIT_USAGE
        return _run_client(command, args)
    if args.command == "run":
        if run_daemon is None:
            print("cni-agent: run: this entry point has no daemon (use `cni-agent run`)", file=sys.stderr)
            return EXIT_USAGE
        return run_daemon(args.config, getattr(args, "bus", None))
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    result: int = args.func(args)
    return result
