"""`cni-agent config check` and `config show`, the real CLI on real files: no agent, no bus."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cni_agent.config import load_config, parse_config

TESTDATA = Path("/work/shared/testdata/net.d")
PLUGINS = "/usr/lib/cni"
needs_plugins = pytest.mark.skipif(not os.path.exists(f"{PLUGINS}/bridge"),
                                   reason="needs the reference plugins in /usr/lib/cni")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    # No DBUS_* variables: a bus is never asked.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBUS_")}
    return subprocess.run([sys.executable, "-m", "cni_agent", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def agent_yaml(tmp_path: Path, **extra: object) -> Path:
    conf = tmp_path / "net.d"
    conf.mkdir(exist_ok=True)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"conf_dir": str(conf), "plugin_dirs": [PLUGINS], **extra}))
    return path


def network(tmp_path: Path, filename: str, body: object) -> Path:
    path = tmp_path / "net.d" / filename
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


@needs_plugins
@pytest.mark.parametrize("name", sorted(p.name for p in TESTDATA.glob("*.conflist")))
def test_each_reported_network_file_checks_clean(tmp_path: Path, name: str) -> None:
    cfg = agent_yaml(tmp_path)
    shutil.copy(TESTDATA / name, tmp_path / "net.d" / name)
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 0, out.stdout + out.stderr
    net = json.loads((TESTDATA / name).read_text())["name"]
    assert out.stdout.startswith("ok: ") and f"default network: {net}" in out.stdout
    assert out.stdout.count("\n") == 1 and out.stderr == ""


def _bridge(name: str, version: str = "0.4.0", ptype: str = "bridge") -> dict[str, object]:
    return {"cniVersion": version, "name": name,
            "plugins": [{"type": ptype, "bridge": "cni9", "ipam": {"type": "host-local",
                                                                    "subnet": "10.99.0.0/24"}}]}


BROKEN: dict[str, tuple[dict[str, object], list[str]]] = {
    "not JSON": ({"10-a.conflist": '{"cniVersion": "0.4.0", "name": '}, ["10-a.conflist: "]),
    "an unsupported cniVersion": ({"10-a.conflist": _bridge("a", "9.9.9")},
                                  ["10-a.conflist: cniVersion '9.9.9' is not supported"]),
    "a plugin nowhere": ({"10-a.conflist": _bridge("a", ptype="nosuchplugin")},
                         ["10-a.conflist: ", "nosuchplugin"]),
    "two files, one name": ({"10-a.conflist": _bridge("a"), "20-a.conflist": _bridge("a")},
                            ["20-a.conflist: network 'a' is already defined by"]),
}


@needs_plugins
@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_network_file_is_one_line_and_exit_1(tmp_path: Path, case: str) -> None:
    files, words = BROKEN[case]
    cfg = agent_yaml(tmp_path)
    shutil.copy(TESTDATA / "87-podman-bridge-firewall.conflist", tmp_path / "net.d")
    for filename, body in files.items():
        network(tmp_path, filename, body)
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, lines  # the good file is no problem
    assert all(w in lines[0] for w in words), lines
    assert lines[0].startswith(str(tmp_path / "net.d")), lines


@needs_plugins
def test_no_network_or_a_pinned_default_that_is_not_there_is_a_problem(tmp_path: Path) -> None:
    cfg = agent_yaml(tmp_path)
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 1 and "no valid network configuration" in out.stdout
    cfg = agent_yaml(tmp_path, default_network="pods")
    shutil.copy(TESTDATA / "100-crio-bridge.conflist", tmp_path / "net.d")
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        f"{tmp_path / 'net.d'}: default_network pods ({cfg}) is not a valid network here"]


@needs_plugins
@pytest.mark.skipif(os.geteuid() != 0, reason="the trust checks apply to a root agent")
def test_a_plugin_only_in_an_untrusted_dir_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bin"
    bad.mkdir()
    shutil.copy(f"{PLUGINS}/bridge", bad / "mybridge")
    bad.chmod(0o777)  # anyone could replace what root would run
    cfg = agent_yaml(tmp_path)
    cfg.write_text(yaml.safe_dump({"conf_dir": str(tmp_path / "net.d"),
                                   "plugin_dirs": [str(bad), PLUGINS]}))
    network(tmp_path, "10-a.conflist", _bridge("a", ptype="mybridge"))
    out = cli("config", "check", "--config", str(cfg))
    assert out.returncode == 1
    lines = out.stdout.splitlines()
    assert len(lines) == 3, lines  # the dir, the network, and then: nothing valid
    assert lines[0].startswith(f"{bad}: plugin directory refused") and "writable by non-root" in lines[0]
    assert "refusing to run" in lines[1] and lines[1].startswith(str(tmp_path / "net.d" / "10-a"))


@pytest.mark.parametrize(("files", "message"), [
    ({"agent.yaml": "conf_dri: /x\n"}, "agent.yaml: conf_dri: unknown key"),
    ({"agent.yaml": "log_level: debug\n", "agent.yaml.d/50-x.yaml": "timeouts: {dell: 1}\n"},
     "agent.yaml.d/50-x.yaml: timeouts.dell: unknown key"),
    ({"agent.yaml": "[unclosed\n"}, "agent.yaml: not valid YAML"),
    # The quota keys are checked as the daemon checks them (issue 44).
    ({"agent.yaml": "access: {members_share: 2}\n"},
     "agent.yaml: access.members_share: must be a number from 0 to 1"),
    ({"agent.yaml": "access: {max_attachments: -1}\n"},
     "agent.yaml: access.max_attachments: must be a whole number of at least 0"),
    ({}, "agent.yaml: no such file"),
])
def test_an_unusable_configuration_exits_2_naming_file_and_key(
        tmp_path: Path, files: dict[str, str], message: str) -> None:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for verb in ("check", "show"):
        out = cli("config", verb, "--config", str(tmp_path / "agent.yaml"))
        assert out.returncode == 2, out
        assert out.stdout == ""
        assert out.stderr.startswith(f"cni-agent: {tmp_path}/") and message in out.stderr
        assert out.stderr.count("\n") == 1


def test_show_prints_the_merged_config_with_each_keys_origin(tmp_path: Path) -> None:
    main = tmp_path / "agent.yaml"
    main.write_text("conf_dir: /srv/net.d\ntimeouts: {add: 100}\n")
    (tmp_path / "agent.yaml.d").mkdir()
    site = tmp_path / "agent.yaml.d" / "50-site.yaml"
    site.write_text("timeouts: {del: 90}\naccess: {groups: [wheel]}\n")
    out = cli("config", "show", "--config", str(main))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"# files read, in order: {main}, {site}"

    def line(text: str) -> str:
        return next(x for x in lines if x.startswith(text))

    assert line("conf_dir: /srv/net.d ").endswith(f"# {main}")
    assert line("  add: 100 ").endswith(f"# {main}")
    assert line("  del: 90 ").endswith(f"# {site}")
    assert line("  groups: [wheel] ").endswith(f"# {site}")
    assert line("  check: 30 ").endswith("# default")
    assert line("state_dir: /var/lib/cni-agent ").endswith("# default")
    # The text is YAML that loads back as the same configuration.
    assert parse_config(yaml.safe_load(out.stdout), "shown") == load_config(str(main))

    js = json.loads(cli("config", "show", "--json", "--config", str(main)).stdout)
    assert js["files"] == [str(main), str(site)]
    assert js["config"]["timeouts"]["del"] == 90 and js["config"]["conf_dir"] == "/srv/net.d"
    assert js["origins"]["timeouts.del"] == str(site) and js["origins"]["bus"] == "default"
