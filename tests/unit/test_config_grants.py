"""`access.host_ports` and `access.cni_args` (issue 44): checked at load with
an error naming the file and the key, by `cni-agent config check` and `cni-agent
run` alike, and handed to the policy parsed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cni_agent.config import AgentConfig, ConfigFileError, load_config
from cni_agent.service.wiring import policy_of


def _write(tmp_path: Path, access: object) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({
        "conf_dir": str(tmp_path / "net.d"), "state_dir": str(tmp_path / "state"),
        "runtime_dir": str(tmp_path / "run"), "plugin_dirs": [str(tmp_path / "bin")],
        "fallback_network": True, "access": access}))
    return path


def cni_agent(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}
    return subprocess.run([sys.executable, "-m", "cni_agent", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_none_by_default() -> None:
    a = AgentConfig().access
    assert a.host_ports == () and a.cni_args == ()
    policy = policy_of(AgentConfig())
    assert policy.open_host_ports == () and policy.open_cni_args == frozenset()


def test_ranges_and_keys_load_and_reach_the_policy(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("access: {host_ports: [20000-20999, '8080', 9090],\n"
                    "         cni_args: [K8S_POD_NAMESPACE, FOO.bar-1]}\n")
    cfg = load_config(str(path))
    assert cfg.access.host_ports == ("20000-20999", "8080", "9090")
    assert cfg.access.cni_args == ("K8S_POD_NAMESPACE", "FOO.bar-1")
    policy = policy_of(cfg)
    assert policy.open_host_ports == ((20000, 20999), (8080, 8080), (9090, 9090))
    assert policy.open_cni_args == {"K8S_POD_NAMESPACE", "FOO.bar-1"}


BAD = [
    ({"host_ports": "20000-20999"}, "access.host_ports: must be a list"),
    ({"host_ports": ["20000-"]}, "access.host_ports[0]: '20000-': must be a port (8080) or a "
                                 "range of ports (20000-20999)"),
    ({"host_ports": ["80", "0"]}, "access.host_ports[1]: '0': ports are 1 to 65535"),
    ({"host_ports": ["70000"]}, "access.host_ports[0]: '70000': ports are 1 to 65535"),
    ({"host_ports": ["2000-1000"]}, "access.host_ports[0]: '2000-1000': the range's first port "
                                    "is above its last"),
    ({"host_ports": [True]}, "access.host_ports[0]: must be a string, not True"),
    ({"cni_args": "FOO"}, "access.cni_args: must be a list"),
    ({"cni_args": ["A=B"]}, "access.cni_args[0]: 'A=B' is not a CNI_ARGS key"),
    ({"cni_args": ["FOO", ""]}, "access.cni_args[1]: '' is not a CNI_ARGS key"),
    ({"cni_args": ["IP"]}, "access.cni_args[0]: IP does what capability 'ips' does: open it "
                           "with access.capabilities instead"),
    ({"cni_args": ["mac"]}, "access.cni_args[0]: mac does what capability 'mac' does"),
]


@pytest.mark.parametrize(("access", "message"), BAD)
def test_a_bad_value_is_named_at_load(tmp_path: Path, access: object, message: str) -> None:
    path = _write(tmp_path, access)
    with pytest.raises(ConfigFileError) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"{path}: {message}")


@pytest.mark.parametrize(("access", "message"), [BAD[1], BAD[9]])
def test_config_check_and_run_refuse_as_the_daemon_would(tmp_path: Path, access: object,
                                                         message: str) -> None:
    path = _write(tmp_path, access)
    for verb in (("config", "check"), ("run",)):
        out = cni_agent(*verb, "--config", str(path))
        assert out.returncode == 2 and f"{path}: {message}" in out.stderr, (verb, out)


def test_config_check_accepts_good_ranges_and_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, {"host_ports": ["20000-20999", 8080], "cni_args": ["K8S_POD_NAME"]})
    out = cni_agent("config", "check", "--config", str(path))
    assert out.returncode == 0 and out.stdout.startswith("ok: "), out
