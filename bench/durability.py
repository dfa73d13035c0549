"""6. What durable sandbox records cost: the journal's append and group commit,
against the per-file durable write the agent used before it.

Before the journal every record write was a file of its own, fsynced before
its rename and the directory after (three per Setup+Teardown). Now each is a
line appended to the journal, and only an intent is committed (one
fdatasync, shared by every caller waiting at that moment). Measured on
/var/tmp, the file system a node's /var/lib/cni-agent usually lives on,
with a one-attachment record: the old write, an append, an append with its
commit, and 8 appends committed at once (a burst of Setups).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench.report import figure, result
from cni_agent.cni.cache import atomic_write
from cni_agent.node.netns import NetnsId
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord
from cni_agent.sandboxes.store import SandboxStore, dumps

BURST = 8


def run(smoke: bool) -> dict[str, Any]:
    rounds = 3 if smoke else 300
    top = tempfile.mkdtemp(prefix="cni-bench-durable-", dir="/var/tmp")
    try:
        store = SandboxStore(top)
        store.open()
        rec = SandboxRecord("bench", "/run/netns/bench", NetnsId(4, 4026532000, 7, "boot"), (
            Attachment("pods", "eth0", b'{"cniVersion":"1.0.0","name":"pods","plugins":[{}]}' * 8,
                       (("K8S_POD_NAME", "web"),), {"portMappings": []}, Phase.READY,
                       result={"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.2/24"}]}),))
        data = dumps(rec)
        old_path = os.path.join(top, "old-record.json")
        samples: dict[str, list[float]] = {"old": [], "append": [], "commit": [], "burst": []}

        async def measure() -> None:
            for _ in range(rounds):  # interleaved, so drift hits all alike
                t0 = time.perf_counter()
                atomic_write(old_path, data)
                t1 = time.perf_counter()
                store.write(rec)
                t2 = time.perf_counter()
                store.write(rec)
                await store.commit()
                t3 = time.perf_counter()
                for _ in range(BURST):
                    store.write(rec)
                await asyncio.gather(*(store.commit() for _ in range(BURST)))
                t4 = time.perf_counter()
                samples["old"].append((t1 - t0) * 1e3)
                samples["append"].append((t2 - t1) * 1e3)
                samples["commit"].append((t3 - t2) * 1e3)
                samples["burst"].append((t4 - t3) * 1e3 / BURST)
            await store.close()

        asyncio.run(measure())
        fs = os.statvfs(top)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    old, commit = statistics.median(samples["old"]), statistics.median(samples["commit"])
    return result([
        figure("durability.write.old", samples["old"],
               note="a record file fsynced, renamed, its directory fsynced (before the journal)"),
        figure("durability.write.append", samples["append"],
               note="a journal line appended: the ready, deleting and check writes"),
        figure("durability.write.commit", samples["commit"], ratio=commit / old if old else None,
               note="a line appended and committed (fdatasync, on the journal's thread): an "
                    "intent; ratio against the old write"),
        figure("durability.write.burst", samples["burst"],
               note=f"per line, {BURST} appended and committed at once: one group commit"),
    ], [f"durability: {len(data)} byte record on /var/tmp (block size {fs.f_bsize})"])
