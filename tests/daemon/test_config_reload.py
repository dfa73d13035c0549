"""SIGHUP and Reload() re-read the agent's own config files, drop-ins included."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.agent import Agent
from tests.support.plugins import wait_for

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."


def test_a_drop_in_takes_effect_on_reload(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet("alpha", "10-alpha.conflist")
    testnet("beta", "20-beta.conflist")
    agent = make_agent()
    assert agent.prop("DefaultNetwork") == "alpha"  # the first valid one
    dropins = Path(f"{agent.config_path}.d")
    dropins.mkdir()
    (dropins / "50-pin.yaml").write_text("default_network: beta\n")
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: agent.prop("DefaultNetwork") == "beta", timeout=10)
    assert agent.call("WaitReady", "d", "10")[0] is True

    # A broken drop-in: Reload names the file and the key, and nothing changes.
    (dropins / "60-typo.yaml").write_text("default_netwrok: alpha\n")
    out = agent.gdbus("Reload")
    assert out.returncode != 0
    assert f"{ERR}InvalidArgument" in out.stderr
    assert f"{dropins / '60-typo.yaml'}: default_netwrok: unknown key" in out.stderr
    assert agent.prop("DefaultNetwork") == "beta"

    # Masked by an empty file of the same name: the pin is gone, alpha again.
    (dropins / "60-typo.yaml").unlink()
    (dropins / "50-pin.yaml").write_text("")
    agent.call("Reload")
    assert agent.prop("DefaultNetwork") == "alpha"

    # A key that names a resource in use is re-read, and waits for a restart.
    (dropins / "70-dir.yaml").write_text(f"conf_dir: {tmp_path / 'elsewhere'}\n")
    agent.call("Reload")
    assert agent.prop("DefaultNetwork") == "alpha"
    assert "conf_dir changed to" in agent.log() and "takes effect at the next restart" in agent.log()
    assert agent.stop() == 0
