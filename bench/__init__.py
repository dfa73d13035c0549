"""Benchmarks of cni-agent: `python -m bench [--smoke] [--json PATH] [--only NAME…]`.

Each benchmark module has `run(smoke: bool) -> dict` (see `report.result`) and
is listed in `registry.BENCHMARKS`. Numbers are printed and written to JSON,
never asserted: goals live here, not in timed tests. Needs root (network
namespaces, a private dbus-daemon, real plugins) and gcc.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# `tests.support` (the private bus, the agent subprocess) lives at the repo root.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
