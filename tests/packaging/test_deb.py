"""The .deb, built from the tree, installed with apt, run on Debian's own Python
(python3-dbus-fast 1.84, python3-pyroute2 0.7, python3-pyinotify), then purged."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import machine_wide, unique_name
from tests.support.agent import REPO, Bus, NotifySocket
from tests.support.docs import links
from tests.support.net import addresses, allocations, delete_link
from tests.support.plugins import wait_for
from tests.support.shim import run_shim, shim_conf

INSTALLED_SHIM = "/usr/lib/cni/cni-agent-shim"

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs a Debian system")]

INSTALLED_POLICY = Path("/usr/share/dbus-1/system.d/org.cniagent.Agent1.conf")
EXPECTED = [
    "/usr/bin/cni-agent",
    "/lib/systemd/system/cni-agent.service",
    "/lib/systemd/system/cni-sandbox@.service",
    "/usr/share/dbus-1/system.d/org.cniagent.Agent1.conf",
    "/usr/share/dbus-1/system-services/org.cniagent.Agent1.service",
    "/usr/share/dbus-1/interfaces/org.cniagent.Agent1.xml",
    "/usr/lib/sysusers.d/cni-agent.conf",
    "/usr/lib/tmpfiles.d/cni-agent.conf",
    "/usr/lib/cni-agent/agent.yaml",  # the defaults; /etc is the admin's alone
    "/usr/lib/cni-agent/agent.yaml.d",
    "/etc/cni-agent/agent.yaml.d",
    "/usr/lib/cni/cni-agent-shim",  # where Debian's runtimes look for plugins
    "/usr/lib/python3/dist-packages/cni_agent/service/daemon.py",
    "/usr/share/man/man8/cni-agent.8.gz",
    "/usr/share/man/man8/cni-agent-shim.8.gz",
    "/usr/share/man/man8/cni-sandbox@.service.8.gz",
    "/usr/share/man/man5/cni-agent.yaml.5.gz",
    "/usr/share/man/man5/org.cniagent.Agent1.5.gz",
    "/usr/share/bash-completion/completions/cni-agent",
    "/usr/share/polkit-1/actions/org.cniagent.Agent1.policy",
    "/usr/share/polkit-1/rules.d/50-org.cniagent.Agent1.rules",
    "/usr/share/cni-agent/monitoring/cni-agent-alerts.yml",  # the fleet view
    "/usr/share/cni-agent/monitoring/cni-agent-dashboard.json",
    # Uncompressed: the units' Documentation= names README.md, which links the
    # pages in docs/, which link examples/ and the man pages' sources.
    "/usr/share/doc/cni-agent/README.md",
    "/usr/share/doc/cni-agent/docs/troubleshooting.md",
    "/usr/share/doc/cni-agent/docs/man/cni-agent.8.rst",
    "/usr/share/doc/cni-agent/examples/agent/net.d/10-podnet.conflist",
]
DOC_DIR = Path("/usr/share/doc/cni-agent")


def _run(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def installed() -> Iterator[list[str]]:
    with machine_wide("installed"):  # polkit's tests use what the package installs
        yield from _installed()


def _installed() -> Iterator[list[str]]:
    if _run("dpkg-query", "-W", "cni-agent").returncode == 0:
        pytest.fail("cni-agent is already installed on this machine; remove it first")
    state_existed = Path("/var/lib/cni-agent").exists()
    build = _run(str(REPO / "tools" / "build-deb"), cwd=REPO)
    assert build.returncode == 0, build.stderr
    deb = Path(build.stdout.strip().splitlines()[-1])
    assert deb.exists()
    out = _run("apt-get", "install", "-y", "-q", "--no-install-recommends", str(deb),
               env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    files = _run("dpkg", "-L", "cni-agent").stdout.split()
    try:
        yield files
    finally:
        purge = _run("apt-get", "purge", "-y", "-q", "cni-agent",
                     env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        assert purge.returncode == 0, purge.stdout + purge.stderr
        leftovers = [f for f in files if Path(f).is_file()]
        assert leftovers == [], leftovers
        assert not Path("/etc/cni-agent").exists()
        # Debian policy: the state of the node's networks is not deleted by a purge.
        assert Path("/var/lib/cni-agent").is_dir()
        if not state_existed:
            shutil.rmtree("/var/lib/cni-agent")


def test_files_land_where_the_policy_says(installed: list[str]) -> None:
    for path in EXPECTED:
        assert path in installed, path
        assert Path(path).exists(), path
    # `man cni-agent` finds the installed page (and each other page by name).
    for page, section in (("cni-agent", "8"), ("cni-agent.yaml", "5"), ("org.cniagent.Agent1", "5"),
                          ("cni-agent-shim", "8"), ("cni-sandbox@.service", "8")):
        found = _run("man", "-w", section, page)
        assert found.returncode == 0 and found.stdout.startswith("/usr/share/man/"), found
    # No conffile: an upgrade of a node whose admin edited the config never asks.
    conffiles = _run("dpkg-query", "-W", "-f=${Conffiles}", "cni-agent").stdout
    assert conffiles.strip() == ""
    assert not Path("/etc/cni-agent/agent.yaml").exists()
    # The installed agent reads the package's defaults from /usr/lib.
    shown = _run("/usr/bin/cni-agent", "config", "show", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0] == "# files read, in order: /usr/lib/cni-agent/agent.yaml"
    assert Path("/var/lib/cni-agent").is_dir()  # tmpfiles.d at install
    assert _run("getent", "group", "cni-agent").returncode == 0  # sysusers.d at install


def test_every_relative_link_of_the_installed_docs_resolves_inside_the_package(
        installed: list[str]) -> None:
    pages = sorted(DOC_DIR.rglob("*.md"))
    assert DOC_DIR / "README.md" in pages and DOC_DIR / "docs" / "runtimes.md" in pages
    checked = 0
    for page in pages:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            dest = Path(os.path.normpath(page.parent / target.partition("#")[0]))
            assert dest.exists() and str(dest) in installed, \
                f"{page}: link to {target}: {dest} is not in the package"
            checked += 1
    assert checked >= 100, checked


def test_installed_agent_runs_on_debians_python(installed: list[str], tmp_path: Path,
                                                netns: str) -> None:
    versions = _run("/usr/bin/python3", "-c",
                    "import dbus_fast.__version__ as d, pyroute2, sys; "
                    "print(d.__version__, pyroute2.__version__, sys.version.split()[0])")
    assert versions.stdout.startswith("1.84"), versions.stdout  # Debian's, not the venv's
    bus = Bus("system", policy_file=INSTALLED_POLICY)
    bridge = unique_name("cab")
    conf = tmp_path / "net.d"
    conf.mkdir()
    (conf / "10-deb.conflist").write_text(json.dumps({
        "cniVersion": "0.4.0", "name": "debnet",
        "plugins": [{"type": "bridge", "bridge": bridge, "isGateway": True,
                     "ipam": {"type": "host-local", "subnet": "10.217.0.0/24",
                              "dataDir": str(tmp_path / "ipam")}}],
    }))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "conf_dir": str(conf), "plugin_dirs": ["/usr/lib/cni"], "bus": bus.address,
        "state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run"),
        "shutdown_drain": 0}))
    notify = NotifySocket(tmp_path)
    agent = subprocess.Popen(["/usr/bin/cni-agent", "run", "--config", str(cfg)],
                             env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                  "NOTIFY_SOCKET": notify.path},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    busctl = ["busctl", f"--address={bus.address}"]
    obj = ["org.cniagent.Agent1", "/org/cniagent/Agent1", "org.cniagent.Agent1"]
    try:
        notify.wait_for("READY=1", timeout=30)
        wait_for(lambda: _run(*busctl, "get-property", *obj, "NetworkReady").stdout.strip()
                 == "b true", timeout=15)
        setup = _run(*busctl, "--json=short", "call", *obj, "Setup", "ssa{sv}", "deb1", netns, "0")
        assert setup.returncode == 0, setup.stderr
        result = json.loads(json.loads(setup.stdout)["data"][0])
        address = result["attachments"][0]["result"]["ips"][0]["address"]
        assert addresses(netns) == [address]
        teardown = _run(*busctl, "call", *obj, "Teardown", "ssa{sv}", "deb1", netns, "0")
        assert teardown.returncode == 0, teardown.stderr
        assert allocations(tmp_path / "ipam", "debnet") == []
        # The installed shim, exec'd as a runtime execs it, against the installed agent.
        pods = shim_conf("pods", "debnet", "1.0.0")
        add = run_shim(bus.address, "ADD", pods, cid="deb2", netns=netns, binary=INSTALLED_SHIM)
        assert add.rc == 0, add
        assert addresses(netns) == [add.out["ips"][0]["address"]]
        assert run_shim(bus.address, "DEL", pods, cid="deb2", netns=netns,
                        binary=INSTALLED_SHIM).rc == 0
        assert allocations(tmp_path / "ipam", "debnet") == [] and addresses(netns) == []
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        log = agent.communicate()[0]
        notify.close()
        bus.stop()
        delete_link(bridge)
    assert "Traceback" not in log, log
