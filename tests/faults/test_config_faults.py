"""Configuration faults: readiness and the status text stay truthful and recover
without a restart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.conftest import plug
from tests.support.agent import Agent
from tests.support.plugins import Control, conflist, install_plugin, wait_for, write_conf

pytestmark = pytest.mark.root


def test_invalid_files_are_reported_and_do_not_hide_good_ones(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, tmp_path: Path
) -> None:
    testnet("good", filename="50-good.conflist")
    agent = make_agent()
    conf = tmp_path / "net.d"
    (conf / "10-broken.conflist").write_text('{"cniVersion": "1.1.0", "name": "bro')
    wait_for(lambda: "10-broken.conflist" in agent.prop("Status"))
    assert agent.prop("NetworkReady") is True and agent.prop("DefaultNetwork") == "good"
    assert "not valid JSON" in agent.prop("Status")
    (conf / "10-broken.conflist").unlink()
    write_conf(conf, "20-unknown.conflist", conflist("unknown", [{"type": "no-such-plugin"}]))
    wait_for(lambda: "no binary 'no-such-plugin'" in agent.prop("Status"))
    (conf / "20-unknown.conflist").unlink()
    write_conf(conf, "30-future.conflist", conflist("future", [plug(control)], "1.1.0"))
    control.update(versions=["0.4.0", "1.0.0"])
    (tmp_path / "bin" / "testplug.control").symlink_to(control.path)
    os.utime(tmp_path / "bin" / "testplug")  # a "new" binary: asked for VERSION again
    wait_for(lambda: "does not support cniVersion 1.1.0" in agent.prop("Status"))
    assert agent.prop("NetworkReady") is False  # the default "good" is 1.1.0 too
    control.update(versions=["0.4.0", "1.0.0", "1.1.0"])
    os.utime(tmp_path / "bin" / "testplug")
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_file_replaced_mid_write_recovers(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control, tmp_path: Path
) -> None:
    path = testnet("only")
    agent = make_agent()
    data = path.read_bytes()
    with open(path, "wb") as f:  # a writer that is not atomic, caught halfway
        f.write(data[: len(data) // 2])
        f.flush()
        wait_for(lambda: agent.prop("NetworkReady") is False)
        assert "not valid JSON" in agent.prop("LastError")
        f.write(data[len(data) // 2:])
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_conf_dir_that_cannot_be_listed(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet()
    agent = make_agent()
    conf = tmp_path / "net.d"
    shutil.move(conf, tmp_path / "saved")
    conf.write_text("a file where a directory should be")
    wait_for(lambda: "cannot list directory" in agent.prop("LastError"))
    assert agent.prop("NetworkReady") is False
    conf.unlink()
    shutil.move(tmp_path / "saved", conf)
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_conf_dir_deleted_and_recreated_100_times_while_setups_run(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str], tmp_path: Path,
) -> None:
    saved = testnet().read_bytes()
    agent = make_agent(timeouts={"ready": 5})
    conf = tmp_path / "net.d"
    namespaces = [netns_factory() for _ in range(4)]
    errors: list[str] = []
    stop = threading.Event()

    def churn_setups() -> None:
        i = 0
        while not stop.is_set():
            sid, ns = f"churn{i % 4}", namespaces[i % 4]
            for method in ("Setup", "Teardown"):
                out = agent.gdbus(method, sid, ns, "{}")
                if out.returncode != 0 and "Error.NotReady" not in out.stderr:
                    errors.append(out.stderr)
            i += 1

    worker = threading.Thread(target=churn_setups)
    worker.start()
    try:
        for i in range(100):
            shutil.rmtree(conf)
            wait_for(lambda: agent.prop("NetworkReady") is False, timeout=5)
            conf.mkdir()
            write_conf(conf, f"{i:03d}-net.conflist", saved)
            wait_for(lambda: agent.prop("NetworkReady") is True, timeout=5)
    finally:
        stop.set()
        worker.join(60)
    assert errors == []
    for i in range(4):
        agent.gdbus("Teardown", f"churn{i}", "", "{}")
    assert agent.call("ListSandboxes")[0] == []


def test_plugin_dir_replaced_by_a_symlink(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet(version="1.0.0")
    agent = make_agent()
    bindir = tmp_path / "bin"
    real = tmp_path / "bin-real"
    shutil.move(bindir, tmp_path / "bin-old")
    wait_for(lambda: agent.prop("NetworkReady") is False)
    real.mkdir(mode=0o755)
    bindir.symlink_to(real)
    install_plugin(real, "testplug")
    wait_for(lambda: agent.prop("NetworkReady") is True)
    (real / "testplug").unlink()
    wait_for(lambda: agent.prop("NetworkReady") is False)


def test_plugins_writable_by_other_users_are_refused(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], tmp_path: Path
) -> None:
    testnet(version="1.0.0")
    agent = make_agent()
    os.chmod(tmp_path / "bin" / "testplug", 0o777)
    wait_for(lambda: agent.prop("NetworkReady") is False)
    assert "writable by non-root users" in agent.prop("LastError")
    os.chmod(tmp_path / "bin" / "testplug", 0o755)
    wait_for(lambda: agent.prop("NetworkReady") is True)
    os.chmod(tmp_path / "bin", 0o777)
    wait_for(lambda: agent.prop("NetworkReady") is False)
    assert f"{tmp_path / 'bin'} is writable by non-root users" in agent.prop("LastError")
    os.chmod(tmp_path / "bin", 0o755)
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_non_root_callers_are_denied_after_a_reload(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], netns: str
) -> None:
    testnet()
    agent = make_agent()
    agent.call("Reload")
    assert agent.proc is not None
    subprocess.run(["kill", "-HUP", str(agent.proc.pid)], check=True)
    time.sleep(0.3)
    for method, args in (("Setup", ("x", netns, "{}")), ("Teardown", ("x", "", "{}")),
                         ("Check", ("x", netns, "{}")), ("GarbageCollect", ("@as []",)),
                         ("Reload", ()), ("SetPodCIDRs", ("@as []",)), ("Show", ("x",)),
                         ("ListSandboxes", ())):
        out = agent.gdbus(method, *args, user="nobody")
        assert "AccessDenied" in out.stderr, (method, out.stderr)
    assert json.loads(json.dumps(agent.prop("NetworkReady", user="nobody"))) is True
