"""What a state dir's journal holds, for tests: read beside a running agent,
and damaged (the agent stopped) the way a power cut or a newer agent would.

Records are the agent's JSON documents (`SandboxRecord.to_json`: "sandbox",
"netns", "netnsId", "phase", "owner", "attachments" with "phase", "check",
"result", ...), the latest of each sandbox, as `cni_agent.sandboxes.store.recorded`
replays them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cni_agent.node.applog import frame, unframe
from cni_agent.sandboxes.store import recorded

Doc = dict[str, Any]


def records(state: Path) -> dict[str, Doc]:
    return recorded(str(state))


def record(state: Path, sid: str) -> Doc | None:
    return records(state).get(sid)


def wait_record(state: Path, sid: str, until: Callable[[Doc | None], bool],
                timeout: float = 10.0) -> Doc | None:
    """The sandbox's record once `until` holds for it (a write on its way)."""
    deadline = time.monotonic() + timeout
    while True:
        doc = record(state, sid)
        if until(doc) or time.monotonic() > deadline:
            return doc
        time.sleep(0.02)


_END = b"~end "  # a snapshot's trailer, "~end <records>" (not JSON)


def _rewrite(state: Path, sid: str, line: Callable[[bytes, Doc, bool], bytes]) -> int:
    """Replace each journal line about `sid` by `line(old line, its record,
    in a snapshot)` (b"" drops it); how many were. A snapshot's trailer is
    skipped, and recounted when lines were dropped: the snapshot stays whole.
    The agent must be stopped."""
    changed = 0
    for path in sorted((state / "journal").iterdir()):
        if path.name.endswith(".tmp"):
            continue
        snapshot = path.name.startswith("snapshot-")
        out = []
        dropped = 0
        for raw in path.read_bytes().splitlines(keepends=True):
            payload = unframe(raw.rstrip(b"\n"))
            if snapshot and payload is not None and payload.startswith(_END):
                if dropped:
                    raw = frame(_END + str(int(payload[len(_END):]) - dropped).encode())
                out.append(raw)
                continue
            try:
                doc = json.loads(payload) if payload else None
            except ValueError:
                doc = None
            if isinstance(doc, dict) and sid in (doc.get("sandbox"), doc.get("deleted")):
                raw = line(raw, doc, snapshot)
                changed += 1
                dropped += not raw
            out.append(raw)
        path.write_bytes(b"".join(out))
    return changed


def lose(state: Path, sid: str) -> int:
    """Every line about `sid` zeroed, as a power cut zeroes what it did not
    write: the journal holds nothing of the sandbox any more. (In a snapshot,
    written whole and synced before it replaced anything, which no power cut
    tears, its lines are left out instead.)"""
    return _rewrite(state, sid,
                    lambda raw, doc, snapshot: b"" if snapshot else b"\0" * (len(raw) - 1) + b"\n")


def replace_latest(state: Path, sid: str, doc: Doc) -> None:
    """The sandbox's latest record replaced by `doc` (a whole line: what a newer
    agent, or an older one, would have written)."""
    seen = [0]
    total = _rewrite(state, sid, lambda raw, old, snapshot: raw)
    assert total, f"no record of {sid} in {state}"

    def line(raw: bytes, old: Doc, snapshot: bool) -> bytes:
        seen[0] += 1
        return frame(json.dumps(doc).encode()) if seen[0] == total else raw

    _rewrite(state, sid, line)
