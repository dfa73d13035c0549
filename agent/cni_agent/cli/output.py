"""What the client commands print: human text (colour only on a TTY), JSON, and help.

Pure functions from the typed values of `cni_agent.cli.client` to strings; the
JSON shapes are documented in `cni_agent.cli.commands`.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from cni_agent.cli.client import AgentStatus, SandboxResult

GREEN, RED, RESET = "\033[32m", "\033[31m", "\033[0m"
READY, NOT_READY = "ready", "not ready"


def colour_enabled(isatty: bool, environ: Mapping[str, str]) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set to anything but ""."""
    return isatty and not environ.get("NO_COLOR")


def readiness(ready: bool, colour: bool, width: int = 0) -> str:
    """ "ready" (green) or "not ready" (red), padded to `width` before colouring."""
    word = (READY if ready else NOT_READY).ljust(width)
    if not colour:
        return word
    return f"{GREEN if ready else RED}{word}{RESET}"


def _list(items: Sequence[str]) -> str:
    return ", ".join(items) if items else "-"


SAVED_NOTE = "(saved by SetPodCIDRs; overrides pod_cidrs in the configuration)"


def pod_cidrs_text(st: AgentStatus) -> str:
    """The pod CIDRs, and when a saved value is in effect, that it overrides the config's."""
    return _list(st.pod_cidrs) + (f" {SAVED_NOTE}" if st.pod_cidrs_source == "saved" else "")


def format_status(st: AgentStatus, colour: bool) -> str:
    rows = [("Network:", readiness(st.network_ready, colour)), ("Status:", st.status),
            ("Default:", st.default_network or "-"), ("Networks:", _list(st.networks)),
            ("Pod CIDRs:", pod_cidrs_text(st))]
    if st.last_error:
        rows.append(("Last error:", st.last_error))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}} {value}" for label, value in rows)


SOURCES = {"config": "configuration (pod_cidrs)",
           "saved": "saved by SetPodCIDRs; overrides pod_cidrs in the configuration until "
                    "`cni-agent pod-cidrs --reset`"}


def format_pod_cidrs(st: AgentStatus) -> str:
    source = SOURCES.get(st.pod_cidrs_source, "unknown (the agent is older than "
                                              "InterfaceRevision 3)")
    return f"Pod CIDRs: {_list(st.pod_cidrs)}\nSource:    {source}"


def _check_note(check: Mapping[str, Any] | None) -> str:
    """What an operator must notice about an attachment (the other states are
    `cni-agent check`'s to show): its CHECK passed before and fails now, its
    CHECK could not run, it is lost, or a repair gave it another address."""
    state = check.get("state") if check else None
    if check is None or state not in ("drifted", "failed-to-run", "lost",
                                      "repaired-with-new-address"):
        return ""
    since = f" at {check['last_check']}" if check.get("last_check") else ""
    reason = check.get("reason") or "no reason given"
    if state == "lost":
        return (f"  lost (removed by a repair whose ADD failed {check.get('attempts', 1)} "
                f"time(s): {reason}; next ADD at {check.get('next_try') or '?'})")
    if state == "repaired-with-new-address":
        return f"  repaired with a new address ({reason})"
    if state == "failed-to-run":
        return f"  check failed to run{since} ({reason})"
    refused = f"; {check['repair']}" if check.get("repair") else ""
    return f"  drifted (CHECK failed{since}: {reason}{refused})"


def format_attachments(result: SandboxResult) -> str:
    """One aligned line per attachment: network, ifname, addresses, and what
    its CHECKs and repairs found that needs an eye."""
    rows = [(a.network, a.ifname, ", ".join(a.addresses) or "-", _check_note(a.check))
            for a in result.attachments]
    if not rows:
        return ""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    text = "\n".join(f"{n:<{w0}}  {i:<{w1}}  {addrs}{note}" for n, i, addrs, note in rows)
    if damaged := result.document.get("damaged_record"):
        text += f"\n(the sandbox's record was damaged: {damaged}; shown from its cache entries)"
    return text


def format_networks(docs: Sequence[Mapping[str, Any]]) -> str:
    """One aligned line per range of each network (NetworkCapacity's documents):
    network, IPAM, range, size, used, free; a network whose capacity is none or
    unknown on one line, with the reason."""
    table = [("NETWORK", "IPAM", "RANGE", "SIZE", "USED", "FREE")]
    notes: dict[int, str] = {}
    for doc in docs:
        name, ipam = str(doc.get("network", "")), ",".join(doc.get("ipam") or ()) or "-"
        if doc.get("capacity") != "known":
            notes[len(table)] = f"{doc.get('capacity', 'unknown')}: {doc.get('reason', '')}"
            table.append((name, ipam, "", "", "", ""))
            continue
        for rs in doc.get("range_sets", ()):
            for r in rs.get("ranges", ()):
                table.append((name, ipam, str(r["range"]), str(r["size"]), str(r["used"]),
                              str(r["free"])))
    widths = [max(len(row[i]) for row in table) for i in range(6)]
    lines = []
    for i, row in enumerate(table):
        if i in notes:
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {notes[i]}")
            continue
        cells = [f"{c:<{w}}" if j < 3 else f"{c:>{w}}"
                 for j, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_checks(rows: Sequence[Mapping[str, Any]]) -> str:
    """One aligned line per attachment: sandbox, network, ifname, state, last CHECK, why."""
    table = [("SANDBOX", "NETWORK", "IFNAME", "CHECK", "LAST CHECK", "REASON")]
    table += [(str(r.get("sandbox", "")), str(r.get("network", "")), str(r.get("ifname", "")),
               str(r.get("state", "")) + (" (repaired)" if r.get("repairs") else ""),
               str(r.get("last_check") or "-"), _why(r))
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    return "\n".join("  ".join(f"{c:<{w}}" for c, w in zip(row[:5], widths, strict=True))
                     + f"  {row[5]}" for row in table)


def _why(row: Mapping[str, Any]) -> str:
    """`check`'s REASON column: the last failure, what the last repair did, a
    lost attachment's next ADD; "-" for an attachment that is plainly ok."""
    if row.get("state") == "ok":
        return "-"
    why = str(row.get("reason") or "-")
    if row.get("repair") and row.get("repair") != row.get("reason"):
        why += f"; {row['repair']}"
    if row.get("state") == "lost":
        why += f"; next ADD at {row.get('next_try') or '?'}"
    return why


def format_change(st: AgentStatus, when: datetime, colour: bool) -> str:
    """One monitor line: local time, ready/not ready, the agent's Status line."""
    stamp = when.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    return f"{stamp}  {readiness(st.network_ready, colour, len(NOT_READY))}  {st.status}"


def change_json(st: AgentStatus, when: datetime) -> dict[str, Any]:
    return {"time": when.astimezone().isoformat(timespec="milliseconds"),
            "agent_running": st.running, **st.to_json()}


def event_json(doc: dict[str, Any], when: datetime) -> dict[str, Any]:
    """`events --json`: the event with its time first (as `monitor --json`'s)."""
    return {"time": when.astimezone().isoformat(timespec="milliseconds"), **doc}


def format_event(doc: dict[str, Any], when: datetime) -> str:
    """One `events` line: local time, the change, the sandbox, then each
    attachment (network, interface, state, addresses, MAC) or the check's state
    and reason."""
    stamp = when.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    if "agent_running" in doc:
        word = "agent back: watching again" if doc["agent_running"] else \
            "agent left the bus: events are not told until it is back"
        return f"{stamp}  {word}"
    head = f"{stamp}  {doc['change']:<9}  {doc['sandbox']}"
    if "attachments" in doc:
        parts = [f"{a['network']} {a['ifname']} {a['state']} "
                 f"{','.join(a['addresses']) or '-'} {a['mac'] or '-'}"
                 for a in doc["attachments"]]
        return f"{head}  {'; '.join(parts)}"
    return f"{head}  {doc['network']} {doc['ifname']} {doc['state']}: {doc['reason']}"


def dumps(doc: Any, one_line: bool = False) -> str:
    """JSON output: indented documents, or one object per line (`monitor --json`)."""
    return json.dumps(doc) if one_line else json.dumps(doc, indent=2)


# --- help text ------------------------------------------------------------------------


class ManFormatter(argparse.HelpFormatter):
    """Wraps prose paragraphs; keeps indented lines (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for block in textwrap.dedent(text).strip().split("\n\n"):
            if block.startswith(" ") or "\n " in block:
                out.append(textwrap.indent(block, indent))
            else:
                out.append(textwrap.fill(" ".join(block.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


BUS_HELP = ("system (honours DBUS_SYSTEM_BUS_ADDRESS), session, or a D-Bus address "
            "(default: system)")
TOP_EPILOG = """
commands talk to the agent over D-Bus (org.cniagent.Agent1); `run` is the agent.
Options before the command (--bus) are accepted after it too.

exit status: 0 success; 1 the operation failed; 2 usage or configuration error;
3 not ready, stopping, or timed out waiting; 4 access denied; 5 the agent is
not running.

environment: DBUS_SYSTEM_BUS_ADDRESS (the system bus), NO_COLOR (any
non-empty value: no colour even on a terminal).

examples:
  $ cni-agent status
  $ cni-agent state
  $ cni-agent wait --timeout 60 && cni-agent setup pod-1 /run/netns/pod-1
  $ cni-agent --bus unix:path=/tmp/cni-agent-bus/bus.sock monitor
"""
