"""`cni-agent shim-config`: the file on stdout, what to do with it on stderr."""

from __future__ import annotations

import json

import pytest

from cni_agent.cli.commands import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict[str, object], str]:
    assert main(["shim-config", *argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


@pytest.mark.parametrize(("runtime", "version"), [("containerd", "1.1.0"), ("crio", "1.1.0"),
                                                  ("podman", "1.0.0")])
def test_each_runtime_gets_the_version_it_needs(capsys: pytest.CaptureFixture[str], runtime: str,
                                                version: str) -> None:
    doc, err = run(capsys, "--runtime", runtime, "--network", "bridge-firewalld", "--name", "pods")
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
