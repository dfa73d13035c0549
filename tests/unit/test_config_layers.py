"""Layered configuration with real files: /usr/lib defaults, /etc, drop-ins, masking."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cni_agent.config import ConfigFileError, config_keys, load_config

DEVNULL = object()  # a symlink to /dev/null

# (files under the two roots "usr" and "etc", {key: (value, origin or "default")})
CASES: dict[str, tuple[dict[str, Any], dict[str, tuple[Any, str]]]] = {
    "nothing: every key its default": (
        {}, {"conf_dir": ("/etc/cni/net.d", "default"), "timeouts.del": (60.0, "default")}),
    "the package's defaults alone": (
        {"usr/agent.yaml": "conf_dir: /usr/net.d\n"}, {"conf_dir": ("/usr/net.d", "usr/agent.yaml")}),
    "/etc over /usr/lib, key by key inside a map": (
        {"usr/agent.yaml": "conf_dir: /usr/net.d\ntimeouts: {add: 5, del: 6}\n",
         "etc/agent.yaml": "timeouts: {del: 7}\n"},
        {"conf_dir": ("/usr/net.d", "usr/agent.yaml"), "timeouts.add": (5.0, "usr/agent.yaml"),
         "timeouts.del": (7.0, "etc/agent.yaml"), "timeouts.check": (30.0, "default")}),
    "an empty or comment-only /etc file changes nothing": (
        {"usr/agent.yaml": "log_level: debug\n", "etc/agent.yaml": "# mine\n"},
        {"log_level": ("debug", "usr/agent.yaml")}),
    "/etc/agent.yaml linked to /dev/null masks the /usr/lib one": (
        {"usr/agent.yaml": "log_level: debug\n", "etc/agent.yaml": DEVNULL},
        {"log_level": ("info", "default")}),
    "drop-ins after both main files, lists replace": (
        {"usr/agent.yaml": "plugin_dirs: [/a, /b]\n", "etc/agent.yaml": "plugin_dirs: [/c]\n",
         "etc/agent.yaml.d/10-dirs.yaml": "plugin_dirs: [/d]\n"},
        {"plugin_dirs": (("/d",), "etc/agent.yaml.d/10-dirs.yaml")}),
    "lexical order of names across both directories": (
        {"usr/agent.yaml.d/30-late.yaml": "default_network: late\n",
         "etc/agent.yaml.d/20-early.yaml": "default_network: early\nbus: session\n"},
        {"default_network": ("late", "usr/agent.yaml.d/30-late.yaml"),
         "bus": ("session", "etc/agent.yaml.d/20-early.yaml")}),
    "a name in /etc masks the same name in /usr/lib (wholly)": (
        {"usr/agent.yaml.d/50-x.yaml": "log_level: debug\nshutdown_drain: 1\n",
         "etc/agent.yaml.d/50-x.yaml": "shutdown_drain: 2\n"},
        {"shutdown_drain": (2.0, "etc/agent.yaml.d/50-x.yaml"), "log_level": ("info", "default")}),
    "an empty file in /etc masks": (
        {"usr/agent.yaml.d/50-x.yaml": "log_level: debug\n", "etc/agent.yaml.d/50-x.yaml": ""},
        {"log_level": ("info", "default")}),
    "a symlink to /dev/null in /etc masks": (
        {"usr/agent.yaml.d/50-x.yaml": "log_level: debug\n", "etc/agent.yaml.d/50-x.yaml": DEVNULL},
        {"log_level": ("info", "default")}),
    "only *.yaml, no hidden files": (
        {"etc/agent.yaml.d/10-a.yml": "log_level: debug\n",
         "etc/agent.yaml.d/10-a.yaml.bak": "log_level: debug\n",
         "etc/agent.yaml.d/.10-a.yaml.swp.yaml": "log_level: debug\n",
         "etc/agent.yaml.d/10-a.conf": "log_level: debug\n"},
        {"log_level": ("info", "default")}),
    "a section left empty in a drop-in changes nothing": (
        {"etc/agent.yaml": "monitor: {interval: 2}\n", "etc/agent.yaml.d/10-m.yaml": "monitor:\n"},
        {"monitor.interval": (2.0, "etc/agent.yaml"), "monitor.grace_period": (0.0, "default")}),
}


def _write(root: Path, files: dict[str, Any]) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if content is DEVNULL:
            p.symlink_to(os.devnull)
        else:
            p.write_text(content)


@pytest.mark.parametrize("case", CASES)
def test_layers(tmp_path: Path, case: str) -> None:
    files, expected = CASES[case]
    _write(tmp_path, files)
    cfg = load_config(dirs=(str(tmp_path / "usr"), str(tmp_path / "etc")))
    for key, (value, origin) in expected.items():
        assert cfg.value(key) == value, key
        want = origin if origin == "default" else str(tmp_path / origin)
        assert cfg.origin(key) == want, key


def test_every_key_has_an_origin(tmp_path: Path) -> None:
    _write(tmp_path, {"etc/agent.yaml": "timeouts: {del: 1}\n"})
    cfg = load_config(dirs=(str(tmp_path / "usr"), str(tmp_path / "etc")))
    origins = {k: cfg.origin(k) for k in config_keys()}
    assert origins["timeouts.del"] == str(tmp_path / "etc/agent.yaml")
    assert {v for k, v in origins.items() if k != "timeouts.del"} == {"default"}
    assert cfg.sources == (str(tmp_path / "etc/agent.yaml"),)


def test_explicit_file_reads_its_own_drop_ins_and_no_layers(tmp_path: Path) -> None:
    _write(tmp_path, {"usr/agent.yaml": "log_level: debug\n",
                      "mine.yaml": "conf_dir: /mine\nshutdown_drain: 3\n",
                      "mine.yaml.d/10-drain.yaml": "shutdown_drain: 4\n"})
    cfg = load_config(str(tmp_path / "mine.yaml"), dirs=(str(tmp_path / "usr"),))
    assert (cfg.conf_dir, cfg.shutdown_drain, cfg.log_level) == ("/mine", 4.0, "info")
    assert cfg.origin("shutdown_drain") == str(tmp_path / "mine.yaml.d/10-drain.yaml")


@pytest.mark.parametrize(("dropin", "message"), [
    ("conf_dri: /x\n", "conf_dri: unknown key"),
    ("timeouts: {dell: 1}\n", "timeouts.dell: unknown key"),
    ("timeouts: 5\n", "timeouts: must be a mapping"),
    ("monitor: {interval: 0}\n", "monitor.interval: must be greater than 0"),
    ("plugin_dirs: [relative]\n", "plugin_dirs[0]: must be an absolute path"),
    ("conf_dir: [unclosed\n", "not valid YAML"),
])
def test_an_error_names_the_drop_in_and_the_key(tmp_path: Path, dropin: str, message: str) -> None:
    _write(tmp_path, {"etc/agent.yaml": "log_level: debug\n",
                      "etc/agent.yaml.d/10-fine.yaml": "bus: session\n",
                      "etc/agent.yaml.d/20-bad.yaml": dropin})
    with pytest.raises(ConfigFileError) as e:
        load_config(dirs=(str(tmp_path / "usr"), str(tmp_path / "etc")))
    assert str(e.value).startswith(str(tmp_path / "etc/agent.yaml.d/20-bad.yaml") + ": ")
    assert message in str(e.value) and "\n" not in str(e.value)
