"""The benchmarks, in the order they run: name → `run(smoke) -> dict`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import (
    checks,
    concurrency,
    cri,
    crio_pattern,
    detection,
    durability,
    footprint,
    hostile,
    overhead,
    real_plugins,
    shim,
)

BENCHMARKS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "overhead": overhead.run,
    "shim": shim.run,
    "real_plugins": real_plugins.run,
    "concurrency": concurrency.run,
    "detection": detection.run,
    "footprint": footprint.run,
    "durability": durability.run,
    "cri": cri.run,
    "crio_pattern": crio_pattern.run,
    "checks": checks.run,
    "hostile": hostile.run,
}
