"""The stop timeout and the shim's backstop follow from the agent's default timeouts.

timeouts.add/del/check bound a whole chain (docs/configuration.md, "Timeouts"), so what a
stop or a shim call may have to wait for is a sum of a few of them. These
sums are written into the unit and the shim by hand; this keeps them honest.
"""

from __future__ import annotations

import re
from pathlib import Path

from cni_agent.config import AgentConfig
from tests.packaging.test_units import UNIT, seconds, unit_entries, values

SHIM = Path(__file__).resolve().parents[2] / "shim" / "cni-agent-shim.c"
DEFAULTS = AgentConfig()


def shim_backstop() -> float:
    source = SHIM.read_text()
    sec = re.search(r"^#define CALL_TIMEOUT_SEC (\d+)ULL$", source, re.M)
    assert sec is not None
    assert "#define CALL_TIMEOUT_USEC (CALL_TIMEOUT_SEC * 1000000ULL)" in source
    return float(sec.group(1))


def test_stop_timeout_covers_the_drain_an_add_chain_and_its_rollback() -> None:
    t = DEFAULTS.timeouts
    stop = seconds(values(unit_entries(UNIT), "Service", "TimeoutStopSec")[0])
    needed = DEFAULTS.shutdown_drain + t.add + t.delete
    # A margin, but not so much that a stuck stop hangs a poweroff for long.
    assert needed < stop <= needed + 30, (stop, needed)


def test_shim_backstop_covers_the_agents_bound_of_an_add() -> None:
    t = DEFAULTS.timeouts
    needed = t.ready + t.lock + t.add + t.delete
    # Past the agent's own Timeout answer, and not the hour it used to be.
    assert needed < shim_backstop() <= needed + 60, (shim_backstop(), needed)
