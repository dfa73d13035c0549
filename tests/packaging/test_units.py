"""The files cni-agent ships besides its Python code: systemd unit and companions,
D-Bus policy and activation file, the default configuration, the RPM spec.

No root needed, except the tests marked `root` (a private dbus-daemon with
Debian's system-bus policy and callers switched to `nobody`; tmpfiles with
owners). Building and installing the .deb is tested elsewhere.
"""

from __future__ import annotations

import configparser
import grp
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "cni-agent.service"
SANDBOX_UNIT = ROOT / "systemd" / "cni-sandbox@.service"
SYSUSERS = ROOT / "systemd" / "cni-agent.sysusers"
TMPFILES = ROOT / "systemd" / "cni-agent.tmpfiles"
POLICY = ROOT / "dbus" / "org.cniagent.Agent1.conf"
ACTIVATION = ROOT / "dbus" / "org.cniagent.Agent1.service"
AGENT_YAML = ROOT / "packaging" / "agent.yaml"
DEBIAN = ROOT / "packaging" / "debian"
NAME = "org.cniagent.Agent1"
PATH = "/org/cniagent/Agent1"

# The configuration file section of CONTRACT.md, plus the keys the project added.
CONTRACT_DEFAULTS = {
    "conf_dir": "/etc/cni/net.d",
    "plugin_dirs": ["/opt/cni/bin", "/usr/libexec/cni", "/usr/lib/cni"],
    "state_dir": "/var/lib/cni-agent",
    "runtime_dir": "/run/cni-agent",
    "default_network": "",
    "fallback_network": False,
    "pod_cidrs": [],
    "monitor": {"startup_interval": 0.5, "interval": 5, "grace_period": 0},
    "timeouts": {"add": 120, "del": 60, "check": 30, "status": 10, "gc": 60,
                 "version": 10, "lock": 60, "ready": 30},
    "shutdown_drain": 10,
    # issue 35: what callers that are not root may use, nothing by default
    "access": {"groups": ["cni-agent"], "networks": [], "capabilities": [], "max_sandboxes": 16,
               "max_attachments": 16, "members_share": 0.5,  # issue 44: quotas
               "host_ports": [], "cni_args": [],  # issue 44: host ports and CNI_ARGS keys
               "unprotected_networks": []},  # issue 44: anti-spoofing
    "gc": {"networks": []},  # added by this project: the GC verb only where declared
    "check": {"interval": 300, "repair": False, "concurrency": 4},  # issue 26: drift
    # added by this project (issue 16): metrics and probes, off; web_config (issue 46): TLS and auth, none
    "http": {"listen": "", "web_config": ""},
    "tracing": {"otlp_endpoint": ""},  # issue 47: spans, off
    "antispoof": "members",  # issue 44: members' bridge attachments filtered
    "bus": "system",
    "log_level": "info",
}


def need(*tools: str) -> None:
    for tool in tools:
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed (tools/setup-system installs it)")


# --- systemd unit ------------------------------------------------------------

def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Section -> (key, value) in order; systemd allows repeated keys."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections


def values(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in sections.get(section, []) if k == key]


def words(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> set[str]:
    return {w for v in values(sections, section, key) for w in v.split()}


def seconds(text: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "ms": 0.001, "min": 60, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(number) * units[unit]
    return total


def man_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose `man` finds our pages, built from docs/man/: verify
    runs `man` for each Documentation=man:… and fails when one is missing."""
    built = tmp_path / "built"
    subprocess.run(["/usr/bin/python3", str(ROOT / "tools" / "build-man"), str(built)],
                   check=True)
    for page in built.iterdir():
        section = tmp_path / "man" / f"man{page.suffix[1:]}"
        section.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, section / page.name)
    return {**os.environ, "MANPATH": f"{tmp_path / 'man'}:"}


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    need("systemd-analyze")
    # `verify` fails when ExecStart's binary does not exist, and /usr/bin/cni-agent
    # exists only once the package is installed: verify a copy whose ExecStart
    # points at the cni-agent of this environment (the venv's console script)
    # or, without one, /bin/true. Everything else is verified as shipped.
    venv_script = Path(sys.executable).parent / "cni-agent"
    binary = shutil.which("cni-agent") or (str(venv_script) if venv_script.exists() else "/bin/true")
    text = UNIT.read_text()
    assert "ExecStart=/usr/bin/cni-agent " in text
    copy = tmp_path / "cni-agent.service"
    copy.write_text(text.replace("ExecStart=/usr/bin/cni-agent ", f"ExecStart={binary} "))
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)],
                          capture_output=True, text=True, cwd=tmp_path, env=man_env(tmp_path))
    # Unknown keys and bad values are only warnings (exit 0): no output at all.
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout + proc.stderr == ""


def test_sandbox_template_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    need("systemd-analyze")
    venv_script = Path(sys.executable).parent / "cni-agent"
    binary = shutil.which("cni-agent") or (str(venv_script) if venv_script.exists() else "/bin/true")
    for unit, name in ((UNIT, "cni-agent.service"), (SANDBOX_UNIT, "cni-sandbox@.service")):
        (tmp_path / name).write_text(unit.read_text().replace("/usr/bin/cni-agent ", f"{binary} "))
    proc = subprocess.run(["systemd-analyze", "verify", "cni-sandbox@web.service"],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**man_env(tmp_path), "SYSTEMD_UNIT_PATH": f"{tmp_path}:"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout + proc.stderr == ""


def test_sandbox_template_orders_itself_inside_the_agents_lifetime() -> None:
    u = unit_entries(SANDBOX_UNIT)
    assert "cni-agent.service" in words(u, "Unit", "Requires")
    assert "cni-agent.service" in words(u, "Unit", "After")  # so it stops before the agent
    assert values(u, "Service", "Type") == ["oneshot"]
    assert values(u, "Service", "RemainAfterExit") == ["yes"]
    assert values(u, "Service", "ExecStart") == ["/usr/bin/cni-agent sandbox up --timeout 60 %i"]
    # Also after a failed or timed-out start: nothing left behind.
    assert values(u, "Service", "ExecStopPost") == ["/usr/bin/cni-agent sandbox down %i"]
    assert values(u, "Install", "WantedBy") == ["multi-user.target"]


def test_unit_runs_the_daemon_as_a_notify_service_on_the_bus() -> None:
    u = unit_entries(UNIT)
    assert values(u, "Service", "Type") == ["notify"]
    assert values(u, "Service", "BusName") == [NAME]
    assert values(u, "Service", "ExecStart") == [
        "/usr/bin/cni-agent run"]  # the layered configuration, /usr/lib then /etc
    assert values(u, "Service", "ExecReload") == ["/bin/kill -HUP $MAINPID"]
    assert values(u, "Service", "Restart") == ["on-failure"]
    assert seconds(values(u, "Service", "WatchdogSec")[0]) > 0
    # Longer than the default shutdown_drain (10 s) plus in-flight work.
    assert seconds(values(u, "Service", "TimeoutStopSec")[0]) >= 60
    assert values(u, "Service", "KillMode") == ["mixed"]
    assert values(u, "Service", "RuntimeDirectory") == ["cni-agent"]
    assert values(u, "Service", "StateDirectory") == ["cni-agent"]
    assert "dbus.socket" in words(u, "Unit", "After")
    # The bus outlives us at shutdown (reverse start order).
    assert "dbus.service" in words(u, "Unit", "After")
    assert "dbus.socket" in words(u, "Unit", "Requires")
    before = words(u, "Unit", "Before")
    assert {"crio.service", "containerd.service", "kubelet.service"} <= before
    # Ordering only: the agent must not pull the runtimes in.
    pulled = words(u, "Unit", "Requires") | words(u, "Unit", "Wants")
    assert not pulled & before
    assert values(u, "Install", "WantedBy") == ["multi-user.target"]


# Each of these gives the service its own mount namespace (or needs one), which
# hides the named network namespaces under /run/netns from the host.
MOUNT_NAMESPACE_OPTIONS = (
    "PrivateTmp", "PrivateDevices", "PrivateMounts", "PrivateNetwork", "PrivateUsers",
    "ProtectSystem", "ProtectHome", "ProtectKernelTunables", "ProtectKernelModules",
    "ProtectKernelLogs", "ProtectControlGroups", "ProtectProc", "ProcSubset",
    "ProtectHostname", "ReadOnlyPaths", "ReadWritePaths", "InaccessiblePaths", "ExecPaths",
    "NoExecPaths", "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "RootDirectory",
    "RootImage", "MountAPIVFS", "DynamicUser", "NetworkNamespacePath",
)


def test_units_point_at_the_man_pages() -> None:
    docs = [w for v in values(unit_entries(UNIT), "Unit", "Documentation") for w in v.split()]
    assert docs[:3] == ["man:cni-agent(8)", "man:cni-agent.yaml(5)", "man:org.cniagent.Agent1(5)"]
    sandbox = unit_entries(UNIT.parent / "cni-sandbox@.service")
    assert "man:cni-agent(8)" in words(sandbox, "Unit", "Documentation")
    pages = {p.name for p in (UNIT.parents[1] / "docs" / "man").glob("*.rst")}
    for ref in docs[:3]:
        name, section = ref[len("man:"):].rstrip(")").split("(")
        assert f"{name}.{section}.rst" in pages, ref


def test_unit_hardening_keeps_network_namespaces_working() -> None:
    u = unit_entries(UNIT)
    keys = {k for k, _ in u["Service"]}
    assert not keys & set(MOUNT_NAMESPACE_OPTIONS)
    assert "User" not in keys  # plugins need real root
    assert values(u, "Service", "NoNewPrivileges") == ["yes"]
    caps = words(u, "Service", "CapabilityBoundingSet")
    assert {"CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE"} <= caps
    assert not caps & {"CAP_SYS_MODULE", "CAP_SETUID", "CAP_SYS_BOOT", "CAP_SYS_TIME"}
    families = words(u, "Service", "RestrictAddressFamilies")
    assert families == {"AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6", "AF_PACKET"}
    assert values(u, "Service", "SystemCallArchitectures") == ["native"]


def test_sysusers_creates_the_cni_agent_group(tmp_path: Path) -> None:
    entries = [line.split() for line in SYSUSERS.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert entries == [["g", "cni-agent", "-"]]
    need("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(SYSUSERS)],
                   check=True, capture_output=True)
    groups = (tmp_path / "etc" / "group").read_text()
    assert re.search(r"^cni-agent:x:\d+:$", groups, re.M), groups


@pytest.mark.root
def test_tmpfiles_creates_the_state_directory(tmp_path: Path) -> None:
    need("systemd-tmpfiles")
    subprocess.run(["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(TMPFILES)],
                   check=True, capture_output=True)
    state = tmp_path / "var" / "lib" / "cni-agent"
    assert state.is_dir()
    assert state.stat().st_mode & 0o7777 == 0o755


# --- D-Bus policy and activation ----------------------------------------------

def policies() -> dict[str, list[dict[str, str]]]:
    """"user=root" / "group=cni-agent" / "context=default" -> its rules as dicts."""
    root = ET.parse(POLICY).getroot()  # raises on malformed XML
    assert root.tag == "busconfig"
    out: dict[str, list[dict[str, str]]] = {}
    for policy in root.findall("policy"):
        ((attr, value),) = policy.attrib.items()
        out[f"{attr}={value}"] = [{"rule": r.tag, **r.attrib} for r in policy]
    return out


def test_policy_root_owns_the_name_and_may_call_everything() -> None:
    p = policies()
    assert p["user=root"] == [
        {"rule": "allow", "own": NAME},
        {"rule": "allow", "send_destination": NAME},
    ]


def test_policy_everyone_reaches_the_interface_and_the_daemon_decides() -> None:
    # The daemon checks root, access.groups and polkit itself; a group rule in
    # the policy would only make polkit's delegation impossible.
    p = policies()
    assert set(p) == {"user=root", "context=default"}
    default = p["context=default"]
    assert {"rule": "deny", "own": NAME} in default
    assert {"rule": "deny", "send_destination": NAME} in default
    allowed = {(r.get("send_interface"), r.get("send_member"))
               for r in default if r["rule"] == "allow"}
    assert allowed == {
        ("org.freedesktop.DBus.Introspectable", "Introspect"),
        ("org.freedesktop.DBus.Peer", None),
        ("org.freedesktop.DBus.Properties", "Get"),
        ("org.freedesktop.DBus.Properties", "GetAll"),
        (NAME, None),
    }
    assert all(r.get("send_destination") == NAME for r in default if r["rule"] == "allow")


def test_activation_file_starts_the_systemd_unit() -> None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(ACTIVATION)
    assert dict(parser["D-BUS Service"]) == {
        "Name": NAME,
        "Exec": "/bin/false",
        "User": "root",
        "SystemdService": "cni-agent.service",
    }


STUB_SERVICE = """
import asyncio, sys
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, dbus_property, method, PropertyAccess

class Agent(ServiceInterface):
    @method()
    def WaitReady(self, timeout: 'd') -> 'b':
        return True
    @method()
    def ListSandboxes(self) -> 'as':
        return []
    @dbus_property(access=PropertyAccess.READ)
    def NetworkReady(self) -> 'b':
        return True

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    bus.export("/org/cniagent/Agent1", Agent("org.cniagent.Agent1"))
    await bus.request_name("org.cniagent.Agent1")
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def system_bus_config(tmp_path: Path, socket_dir: Path, policy: Path) -> Path:
    """Debian's system.conf on a private socket, with only `policy` included."""
    text = Path("/usr/share/dbus-1/system.conf").read_text()
    text = re.sub(r"<user>.*?</user>|<pidfile>.*?</pidfile>|<syslog/>", "", text)
    text = re.sub(r"<listen>.*?</listen>", f"<listen>unix:path={socket_dir}/bus</listen>", text)
    text = re.sub(r"<includedir>.*?</includedir>|<include\b[^>]*>.*?</include>", "", text)
    text = re.sub(r"<standard_system_servicedirs/>|<servicedir>.*?</servicedir>", "", text)
    text = text.replace("</busconfig>", f"<include>{policy}</include>\n</busconfig>")
    conf = tmp_path / "bus.conf"
    conf.write_text(text)
    return conf


@pytest.fixture
def policy_bus(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A private bus with the system bus's rules and our policy, our name owned by
    root; yields the address and a group that stands in for cni-agent (so that no
    group is created on this machine) of which `nobody` is not a member."""
    need("dbus-daemon", "busctl", "setpriv")
    if not Path("/usr/share/dbus-1/system.conf").exists():
        pytest.skip("no /usr/share/dbus-1/system.conf")
    nobody = pwd.getpwnam("nobody")
    stand_in = next(g for g in grp.getgrall()
                    if g.gr_gid not in (0, nobody.pw_gid) and "nobody" not in g.gr_mem)
    policy = tmp_path / "policy.conf"
    policy.write_text(POLICY.read_text())
    # The socket goes where `nobody` can reach it (pytest's tmp_path is 0700).
    socket_dir = Path(tempfile.mkdtemp(prefix="cni-agent-bus-"))
    socket_dir.chmod(0o755)
    conf = system_bus_config(tmp_path, socket_dir, policy)
    daemon = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork",
                               "--print-address=1"], stdout=subprocess.PIPE, text=True)
    service = None
    try:
        assert daemon.stdout is not None
        address = daemon.stdout.readline().strip()
        assert address.startswith("unix:")
        service = subprocess.Popen([sys.executable, "-c", STUB_SERVICE, address],
                                   stdout=subprocess.PIPE, text=True)
        assert service.stdout is not None
        assert service.stdout.readline().strip() == "ready"
        yield address, stand_in.gr_gid
    finally:
        for proc in (service, daemon):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)
        shutil.rmtree(socket_dir, ignore_errors=True)


def busctl_as(address: str, gid: int | None, *args: str) -> subprocess.CompletedProcess[str]:
    """busctl run as `nobody`, with `gid` as its only supplementary group."""
    nobody = pwd.getpwnam("nobody")
    groups = [f"--groups={gid}"] if gid is not None else ["--clear-groups"]
    cmd = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", *groups,
           "busctl", f"--address={address}", "--timeout=5", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


@pytest.mark.root
def test_policy_on_a_real_system_bus(policy_bus: tuple[str, int]) -> None:
    address, group = policy_bus
    call = ("call", NAME, PATH)
    # Anyone: properties, introspection, ping, WaitReady.
    r = busctl_as(address, None, "get-property", NAME, PATH, NAME, "NetworkReady")
    assert (r.returncode, r.stdout.strip()) == (0, "b true"), r.stderr
    r = busctl_as(address, None, *call, "org.freedesktop.DBus.Properties", "GetAll", "s", NAME)
    assert r.returncode == 0, r.stderr
    r = busctl_as(address, None, "introspect", NAME, PATH)
    assert r.returncode == 0 and "WaitReady" in r.stdout, r.stderr
    r = busctl_as(address, None, *call, "org.freedesktop.DBus.Peer", "Ping")
    assert r.returncode == 0, r.stderr
    r = busctl_as(address, None, *call, NAME, "WaitReady", "d", "1")
    assert (r.returncode, r.stdout.strip()) == (0, "b true"), r.stderr
    # Anyone reaches every method of the interface (the daemon decides, and
    # refuses), but no other interface, no property write, and not the name.
    for gid in (None, group):
        r = busctl_as(address, gid, *call, NAME, "ListSandboxes")
        assert (r.returncode, r.stdout.strip()) == (0, "as 0"), r.stderr
    r = busctl_as(address, None, *call, "org.freedesktop.DBus.Properties", "Set", "ssv", NAME,
                  "Status", "s", "x")
    assert r.returncode != 0 and "Access denied" in r.stderr
    r = busctl_as(address, None, *call, "org.example.Other", "Frob")
    assert r.returncode != 0 and "Access denied" in r.stderr
    r = busctl_as(address, None, "call", "org.freedesktop.DBus", "/org/freedesktop/DBus",
                  "org.freedesktop.DBus", "RequestName", "su", NAME, "4")
    assert r.returncode != 0 and "Access denied" in r.stderr
    # Root: everything.
    r = subprocess.run(["busctl", f"--address={address}", *call, NAME, "ListSandboxes"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


# --- default configuration ----------------------------------------------------

KEY_LINE = re.compile(r"^#( *)([a-z_]+):(\s|$)")


def uncommented(text: str) -> str:
    """The file with every commented-out key line (`#key: value`, `#  key: value`)
    made live; explanations (`# Text`, `#  # Text`) stay comments."""
    return "\n".join(line[1:] if KEY_LINE.match(line) else line for line in text.splitlines())


def test_default_config_configures_nothing_as_shipped() -> None:
    assert yaml.safe_load(AGENT_YAML.read_text()) is None


def test_default_config_lists_every_key_with_its_contract_default() -> None:
    assert yaml.safe_load(uncommented(AGENT_YAML.read_text())) == CONTRACT_DEFAULTS


def test_default_config_explains_every_key() -> None:
    lines = AGENT_YAML.read_text().splitlines()
    for i, line in enumerate(lines):
        if KEY_LINE.match(line):
            above = lines[i - 1]  # "# Text" or, inside a section, "#  # Text"
            explained = above.startswith("#") and above.lstrip("# ") and not KEY_LINE.match(above)
            assert explained, f"no one-line explanation above {line!r}"


def test_default_config_is_accepted_by_the_agent() -> None:
    from cni_agent.config import AgentConfig, parse_config

    doc = yaml.safe_load(uncommented(AGENT_YAML.read_text()))
    assert parse_config(doc, "agent.yaml") == AgentConfig()


# --- packages -------------------------------------------------------------------

def test_debian_directory_refers_to_existing_files() -> None:
    for name in ("cni-agent.service", "cni-agent.sysusers", "cni-agent.tmpfiles"):
        assert (DEBIAN / name).resolve(strict=True).parent == ROOT / "systemd"
    for line in (DEBIAN / "cni-agent.install").read_text().splitlines():
        *sources, _dest = line.split()
        for src in sources:
            # build/ holds what debian/rules builds (the shim), not the tree's files.
            if not src.startswith("build/"):
                assert (ROOT / src).is_file(), src
    assert "build/cni-agent-shim usr/lib/cni/" in (DEBIAN / "cni-agent.install").read_text()
    assert "$(MAKE) -C shim OUT=$(CURDIR)/build/cni-agent-shim" in (DEBIAN / "rules").read_text()
    for line in (DEBIAN / "cni-agent.docs").read_text().splitlines():
        assert (ROOT / line.strip()).exists(), line
    for line in (DEBIAN / "cni-agent.examples").read_text().splitlines():
        assert list(ROOT.glob(line.strip())), line
    assert os.access(DEBIAN / "rules", os.X_OK)
    assert (DEBIAN / "source" / "format").read_text().strip() == "3.0 (native)"
    control = (DEBIAN / "control").read_text()
    # The shim is compiled: an architecture-specific package.
    assert re.search(r"^Architecture: any$", control, re.M)


def test_rpm_spec_passes_check_rpm_spec() -> None:
    need("rpmspec")
    proc = subprocess.run([str(ROOT / "tools" / "check-rpm-spec")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout
