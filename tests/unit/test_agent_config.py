"""The YAML configuration: defaults match the contract, mistakes name the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cni_agent.config import AgentConfig, ConfigFileError, load_config


def _load(tmp_path: Path, text: str) -> AgentConfig:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return load_config(str(p))


def test_defaults_match_the_contract() -> None:
    c = AgentConfig()
    assert c.conf_dir == "/etc/cni/net.d"
    assert c.plugin_dirs == ("/opt/cni/bin", "/usr/libexec/cni", "/usr/lib/cni")
    assert (c.state_dir, c.runtime_dir) == ("/var/lib/cni-agent", "/run/cni-agent")
    assert c.default_network == "" and c.fallback_network is False and c.pod_cidrs == ()
    assert (c.monitor.startup_interval, c.monitor.interval, c.monitor.grace_period) == (0.5, 5, 0)
    t = c.timeouts
    assert (t.add, t.delete, t.check, t.status, t.gc, t.version, t.lock, t.ready) == (
        120, 60, 30, 10, 60, 10, 60, 30)
    assert c.shutdown_drain == 10 and c.access.groups == ("cni-agent",)
    # Callers that are not root get nothing until the admin opens it.
    assert (c.access.networks, c.access.capabilities, c.access.max_sandboxes) == ((), (), 16)
    assert (c.access.max_attachments, c.access.members_share) == (16, 0.5)
    assert c.bus == "system" and c.log_level == "info"


def test_every_key_of_the_contract_is_accepted(tmp_path: Path) -> None:
    c = _load(tmp_path, """
conf_dir: /etc/cni/net.d
plugin_dirs: [/opt/cni/bin]
state_dir: /tmp/s
runtime_dir: /tmp/r
default_network: pinned
fallback_network: true
pod_cidrs: [10.244.1.0/24, "fd00::/64"]
monitor: {startup_interval: 0.1, interval: 2, grace_period: 1.5}
timeouts: {add: 1, del: 2, check: 3, status: 4, gc: 5, version: 6, lock: 7, ready: 8}
shutdown_drain: 3
access: {groups: [wheel, cni-agent], networks: [vmnet], capabilities: [portMappings],
         max_sandboxes: 0, max_attachments: 3, members_share: 0.25}
bus: session
log_level: debug
""")
    assert (c.access.networks, c.access.capabilities, c.access.max_sandboxes) == (
        ("vmnet",), ("portMappings",), 0)
    assert (c.access.max_attachments, c.access.members_share) == (3, 0.25)
    assert c.timeouts.delete == 2 and c.monitor.grace_period == 1.5
    assert c.pod_cidrs == ("10.244.1.0/24", "fd00::/64")
    assert c.access.groups == ("wheel", "cni-agent")


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert _load(tmp_path, "").conf_dir == "/etc/cni/net.d"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("conf_dri: /x", "agent.yaml: conf_dri: unknown key"),
        ("monitor: {intervall: 3}", "monitor.intervall: unknown key"),
        ("timeouts: {add: -1}", "timeouts.add: must be a non-negative number"),
        ("timeouts: {add: fast}", "timeouts.add: must be a number of seconds"),
        ("shutdown_drain: -2", "shutdown_drain: must be a non-negative"),
        ("fallback_network: yes please", "fallback_network: must be true or false"),
        ("plugin_dirs: /opt/cni/bin", "plugin_dirs: must be a list"),
        ("plugin_dirs: [relative]", "plugin_dirs[0]: must be an absolute path"),
        ("pod_cidrs: [banana]", "pod_cidrs[0]: 'banana' is not a CIDR"),
        ("log_level: loud", "log_level: must be one of"),
        ("monitor: {interval: 0}", "monitor.interval: must be greater than 0"),
        ("access: {max_sandboxes: -1}", "access.max_sandboxes: must be a whole number of at least 0"),
        ("access: {networks: vmnet}", "access.networks: must be a list"),
        ("access: {max_attachments: 2.5}",
         "access.max_attachments: must be a whole number of at least 0"),
        ("access: {members_share: 1.5}", "access.members_share: must be a number from 0 to 1"),
        ("access: {members_share: half}", "access.members_share: must be a number from 0 to 1"),
        ("access: {members_share: .nan}", "access.members_share: must be a number from 0 to 1"),
        ("access: {members_share: true}", "access.members_share: must be a number from 0 to 1"),
        ("- a list", "the top level must be a mapping"),
        ("conf_dir: [unclosed", "not valid YAML"),
    ],
)
def test_mistakes_are_one_line_naming_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigFileError) as e:
        _load(tmp_path, text)
    assert message in str(e.value)
    assert str(tmp_path / "agent.yaml") in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="no such file"):
        load_config(str(tmp_path / "missing.yaml"))


def test_http_listen_is_off_by_default_and_takes_tcp_or_unix(tmp_path: Path) -> None:
    assert AgentConfig().http.listen == ""
    for text in ("127.0.0.1:9750", "[::1]:9750", "unix:/run/cni-agent/metrics.sock"):
        assert _load(tmp_path, f"http: {{listen: '{text}'}}\n").http.listen == text


@pytest.mark.parametrize("bad", ["9750", "localhost", "127.0.0.1:0", "127.0.0.1:70000",
                                 "unix:relative.sock", ":9750"])
def test_a_bad_http_listen_names_the_key(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigFileError, match=r"http\.listen: '"):
        _load(tmp_path, f"http: {{listen: '{bad}'}}\n")


def test_check_section_defaults_and_keys(tmp_path: Path) -> None:
    c = AgentConfig().check
    assert (c.interval, c.repair, c.concurrency) == (300, False, 4)
    c = _load(tmp_path, "check: {interval: 0, repair: true, concurrency: 16}\n").check
    assert (c.interval, c.repair, c.concurrency) == (0, True, 16)


@pytest.mark.parametrize(("text", "message"), [
    ("check: {intervall: 3}", "check.intervall: unknown key"),
    ("check: {interval: -1}", "check.interval: must be a non-negative number"),
    ("check: {repair: yes please}", "check.repair: must be true or false"),
    ("check: {concurrency: 0}", "check.concurrency: must be a whole number of at least 1"),
])
def test_a_bad_check_key_is_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigFileError, match=re.escape(message)):
        _load(tmp_path, text + "\n")
