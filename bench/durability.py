"""6. What durable sandbox records cost: one record write, plain rename vs fsynced.

Every record write is durable since the power-loss work (file fsynced before
its rename, the directory after), so a power cut can leave neither a 0-byte
record nor an undone phase change. A Setup+Teardown writes the record three
times (intent, ready, deleting); the intent was durable before, so the pair
pays for two more durable writes. Measured on /var/tmp, the file system a
node's /var/lib/cni-agent usually lives on, with a one-attachment record.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench.report import figure, result
from cni_agent.cni.cache import atomic_write
from cni_agent.node.netns import NetnsId
from cni_agent.sandboxes.records import Attachment, Phase, SandboxRecord, SandboxStore

EXTRA_DURABLE_WRITES = 2  # per Setup+Teardown: "ready" and "deleting"


def run(smoke: bool) -> dict[str, Any]:
    rounds = 3 if smoke else 300
    top = tempfile.mkdtemp(prefix="cni-bench-durable-", dir="/var/tmp")
    try:
        store = SandboxStore(top)
        rec = SandboxRecord("bench", "/run/netns/bench", NetnsId(4, 4026532000, 7, "boot"), (
            Attachment("pods", "eth0", b'{"cniVersion":"1.0.0","name":"pods","plugins":[{}]}' * 8,
                       (("K8S_POD_NAME", "web"),), {"portMappings": []}, Phase.READY),))
        store.write(rec)
        with open(store.path("bench"), "rb") as f:
            data = f.read()
        plain: list[float] = []
        durable: list[float] = []
        for _ in range(rounds):  # interleaved, so drift hits both alike
            t0 = time.perf_counter()
            atomic_write(store.path("bench"), data, durable=False)
            t1 = time.perf_counter()
            store.write(rec)
            t2 = time.perf_counter()
            plain.append((t1 - t0) * 1e3)
            durable.append((t2 - t1) * 1e3)
        fs = os.statvfs(top)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    extra = [EXTRA_DURABLE_WRITES * (d - p) for d, p in zip(durable, plain, strict=True)]
    return result([
        figure("durability.write.plain", plain, note="rename only (the ready/deleting writes before)"),
        figure("durability.write.durable", durable, note="file fsync, rename, directory fsync"),
        figure("durability.pair.extra", extra,
               note=f"per Setup+Teardown: {EXTRA_DURABLE_WRITES} writes now durable "
                    f"(median {statistics.median(extra):.2f} ms), off the event loop"),
    ], [f"durability: {len(data)} byte record on /var/tmp (block size {fs.f_bsize})"])
