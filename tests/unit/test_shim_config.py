"""`cni-agent shim-config`: the file on stdout, what to do with it on stderr; the
capabilities its plugin declares are those of the agent network's plugins."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from cni_agent.main import main
from tests.support.plugins import conflist, write_conf


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, Any], str]:
    assert main(["shim-config", *argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


@pytest.fixture
def agent_config(tmp_path: Path) -> str:
    """An agent configuration whose conf_dir holds three networks (in load order):
    one that runs the shim (never the default), podnet, and annotated."""
    conf_dir = tmp_path / "net.d"
    networks = {
        "05-loop": ("loop", [{"type": "cni-agent-shim", "capabilities": {"ips": True}}]),
        "10-podnet": ("podnet", [
            {"type": "bridge", "bridge": "br0", "ipam": {"type": "host-local", "subnet": "10.9.0.0/24"}},
            {"type": "portmap", "capabilities": {"portMappings": True, "snat": False}}]),
        "20-annotated": ("annotated", [
            {"type": "bridge", "capabilities": {"ips": True, "mac": False}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
            {"type": "podinfo", "capabilities": {"io.kubernetes.cri.pod-annotations": True,
                                                 "cgroupPath": True}}]),
    }
    for stem, (name, plugins) in networks.items():
        write_conf(conf_dir, f"{stem}.conflist", conflist(name, plugins, "1.0.0"))
    config = tmp_path / "agent.yaml"
    config.write_text(f"conf_dir: {conf_dir}\n")
    return str(config)


@pytest.mark.parametrize(("runtime", "version"), [("containerd", "1.1.0"), ("crio", "1.1.0"),
                                                  ("podman", "1.0.0")])
def test_each_runtime_gets_the_version_it_needs(capsys: pytest.CaptureFixture[str], runtime: str,
                                                version: str, agent_config: str) -> None:
    doc, err = run(capsys, "--runtime", runtime, "--network", "podnet", "--name", "pods",
                   "--config", agent_config)
    assert doc["cniVersion"] == version and doc["name"] == "pods"
    lines = err.splitlines()
    assert lines and all(line.startswith("# ") for line in lines)
    assert "/etc/cni/net.d/10-pods.conflist" in err
    assert "warning" not in err


def test_the_comments_name_the_runtimes_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert "[plugins.'io.containerd.cri.v1.runtime'.cni] conf_dir" in run(
        capsys, "--runtime", "containerd")[1]
    assert "[crio.network] network_dir" in run(capsys, "--runtime", "crio")[1]
    assert "network_config_dir" in run(capsys, "--runtime", "podman")[1]


def test_cni_version_overrides_the_runtime_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    doc, err = run(capsys, "--runtime", "containerd", "--cni-version", "1.0.0")
    assert doc["cniVersion"] == "1.0.0"
    assert "warning: containerd 2.x wants 1.1.0" in err and "STATUS" in err


def test_without_runtime_every_runtime_reads_it_and_stderr_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    doc, err = run(capsys)
    assert doc["cniVersion"] == "1.0.0" and doc["name"] == "cni-agent"
    assert doc["plugins"][0]["network"] == ""  # type: ignore[index]
    assert "--runtime" in err


def test_name_alone_is_enough(capsys: pytest.CaptureFixture[str]) -> None:
    # --network defaults to "" (the agent's default network); it used to be refused as empty.
    doc, _ = run(capsys, "--name", "pods")
    assert doc["name"] == "pods"


@pytest.mark.parametrize(("argv", "message"), [
    (["--runtime", "docker"], "invalid choice: 'docker'"),
    (["--cni-version", "2.0"], "unsupported cniVersion '2.0'"),
    (["--network", "bad/name"], "--network"),
])
def test_bad_values_are_usage_errors_that_say_why(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["shim-config", *argv])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err


def test_the_plugin_declares_what_the_agent_networks_plugins_declare(
        capsys: pytest.CaptureFixture[str], agent_config: str) -> None:
    doc, err = run(capsys, "--runtime", "crio", "--network", "annotated", "--config", agent_config)
    assert doc["plugins"][0]["capabilities"] == {
        "cgroupPath": True, "io.kubernetes.cri.pod-annotations": True, "ips": True,
        "portMappings": True}
    assert "capabilities: cgroupPath, io.kubernetes.cri.pod-annotations, ips, portMappings" in err
    assert "20-annotated.conflist" in err
    # Only what is declared true, of that network alone.
    doc, _ = run(capsys, "--network", "podnet", "--config", agent_config)
    assert doc["plugins"][0]["capabilities"] == {"portMappings": True}


def test_without_network_the_agents_default_networks_are_read_never_one_running_the_shim(
        capsys: pytest.CaptureFixture[str], agent_config: str, tmp_path: Path) -> None:
    doc, err = run(capsys, "--name", "pods", "--config", agent_config)
    assert doc["plugins"][0] == {"type": "cni-agent-shim", "network": "",
                                 "capabilities": {"portMappings": True}, "queueWhenDown": True}
    assert "network podnet" in err
    drop_in = tmp_path / "agent.yaml.d"
    drop_in.mkdir()
    (drop_in / "default.yaml").write_text("default_network: annotated\n")
    doc, _ = run(capsys, "--config", agent_config)
    assert "cgroupPath" in doc["plugins"][0]["capabilities"]


def test_a_network_not_found_gets_every_known_capability_and_a_warning(
        capsys: pytest.CaptureFixture[str], agent_config: str) -> None:
    doc, err = run(capsys, "--runtime", "crio", "--network", "later", "--config", agent_config)
    caps = doc["plugins"][0]["capabilities"]
    assert {"portMappings", "cgroupPath", "io.kubernetes.cri.pod-annotations"} <= set(caps)
    assert "warning: network later not found in" in err and "run shim-config again" in err


def test_crio_gets_a_drop_in_that_turns_its_status_poll_on(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["shim-config", "--runtime", "crio", "--drop-in"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("# /etc/crio/crio.conf.d/10-cni-agent.conf")
    network = tomllib.loads(out)["crio"]["network"]
    assert network["cni_status_grace_period"] == "1s"
    assert network["network_dir"] == "/etc/cni/net.d/"
    assert {"/usr/libexec/cni", "/usr/lib/cni"} <= set(network["plugin_dirs"])
    assert "cannot make CRI-O notice faster" in out


def test_crio_comments_say_per_version_what_network_ready_does(
        capsys: pytest.CaptureFixture[str], agent_config: str) -> None:
    _, err = run(capsys, "--runtime", "crio", "--config", agent_config)
    for text in ("the agent cannot make CRI-O notice faster", "<= 1.31: no STATUS",
                 "1.32-1.35: polls every 0.5 s only until first ready",
                 "1.36.0-1.36.2: polls every 5 s",
                 "1.36.3 and later: polls every 5 s only when [crio.network] "
                 "cni_status_grace_period > 0", "--drop-in"):
        assert text in err
    assert "1.30" not in err.replace("1.30 and older", "")


@pytest.mark.parametrize("argv", [["--drop-in"], ["--runtime", "containerd", "--drop-in"]])
def test_a_drop_in_is_only_crios(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(["shim-config", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--drop-in is for --runtime crio" in err


def test_queue_when_down_is_written_on_by_default_and_off_on_request(
        capsys: pytest.CaptureFixture[str], agent_config: str) -> None:
    """The C shim reads no YAML: the conflist says whether a DEL no agent
    answers is queued, and where (the agent's state_dir, when not the default)."""
    doc, _ = run(capsys, "--config", agent_config)
    assert doc["plugins"][0]["queueWhenDown"] is True
    assert "stateDir" not in doc["plugins"][0]
    doc, _ = run(capsys, "--no-queue-when-down", "--config", agent_config)
    assert doc["plugins"][0]["queueWhenDown"] is False


def test_a_state_dir_that_is_not_the_default_is_written_for_the_shim(
        capsys: pytest.CaptureFixture[str], agent_config: str, tmp_path: Path) -> None:
    drop_in = Path(agent_config + ".d")
    drop_in.mkdir(exist_ok=True)
    (drop_in / "state.yaml").write_text(f"state_dir: {tmp_path / 'state'}\n")
    doc, _ = run(capsys, "--config", agent_config)
    assert doc["plugins"][0]["stateDir"] == str(tmp_path / "state")
