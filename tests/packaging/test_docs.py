"""The documentation says what the code does, and stays findable: the README's
map and docs/ in step, every link resolving, the D-Bus reference naming exactly
the XML's members, every configuration key with the agent's default, every
test a page cites existing, every message the troubleshooting page quotes one
the agent prints, and the README's first-pod walk-through working on a real
agent.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cni_agent.api import ErrorKind
from cni_agent.cli.commands import build_parser
from cni_agent.service.metrics import Metrics
from tests.conftest import unique_name
from tests.support.agent import Agent, Bus
from tests.support.docs import (
    DOCS,
    README,
    REPO,
    anchors,
    code_spans,
    commands,
    config_defaults,
    documented_defaults,
    exit_statuses,
    fixed_parts,
    links,
    pages,
    printed,
    section,
    tables,
    without_code_blocks,
)

XML = REPO / "dbus" / "org.cniagent.Agent1.xml"


def text(page: str) -> str:
    return (DOCS / page).read_text()


# --- README and its map -------------------------------------------------------------


def readme_map() -> list[str]:
    """The pages the README's "Documentation" section lists, one line each."""
    body = section(README.read_text(), "Documentation")
    entries = re.findall(r"^- \[([^\]]+)\]\(([^)]+)\)", body, re.M)
    assert entries, "the README's Documentation section lists no page"
    for label, target in entries:
        assert label == target, f"map entry [{label}]({target}): say the path it links to"
    return [target for _, target in entries]


def test_the_readme_is_short_and_names_the_two_commands() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) < 200, "README.md has grown past 200 lines: move it to docs/"
    assert "make run" in readme and "make test" in readme


def test_the_readme_map_lists_every_page_once_and_only_pages_that_exist() -> None:
    listed = readme_map()
    assert len(listed) == len(set(listed)), f"a page is listed twice: {listed}"
    on_disk = [str(p.relative_to(REPO)) for p in pages()]
    missing = sorted(set(on_disk) - set(listed))
    assert not missing, f"docs/ pages not in the README's map: {missing}"
    dangling = sorted(set(listed) - set(on_disk))
    assert not dangling, f"the README's map lists pages that do not exist: {dangling}"


def documents() -> Iterator[Path]:
    yield README
    yield REPO / "SECURITY.md"
    yield from pages()


@pytest.mark.parametrize("doc", list(documents()), ids=lambda p: p.name)
def test_every_link_resolves(doc: Path) -> None:
    for target in links(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest.read_text()), \
                f"{doc.name}: link to {target}: no such heading in {dest.name}"


@pytest.mark.parametrize("doc", list(documents()), ids=lambda p: p.name)
def test_every_test_a_page_cites_exists(doc: Path) -> None:
    cited = re.findall(r"(tests/[\w/.-]+\.py)(?:::(\w+))?", doc.read_text())
    for path, name in cited:
        source = REPO / path
        assert source.is_file(), f"{doc.name} cites {path}, which does not exist"
        if name:
            m = re.search(rf"^(@.*\n)*(async )?def {name}\(", source.read_text(), re.M)
            assert m is not None and "fixture" not in m.group(0), \
                f"{doc.name} cites {path}::{name}, which is no test"


def test_pages_cite_the_tests_that_prove_each_guarantee() -> None:
    for page in ("reliability.md", "security.md"):
        guarantees = next(t for t in tables(text(page)) if t.header == ("guarantee", "proved by"))
        assert len(guarantees.rows) >= 30, page
        for claim, proof in guarantees.rows:
            assert re.search(r"tests/|make ", proof), f"{page}: {claim!r} names no test"


def installed_tree() -> dict[str, Path]:
    """What the packages put under /usr/share/doc/cni-agent/, derived from
    packaging/debian as tools/check-rpm-spec derives it (which holds the RPM's
    %files to the same list): installed path -> the tree's file."""
    spec = importlib.util.spec_from_file_location("check_rpm_spec",
                                                  REPO / "tools" / "check_rpm_spec.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    files, _dirs, _packages = tool.deb_paths_from_tree()
    doc_dir = tool.DOC_DIR
    tree = {}
    for path in files:
        if path.startswith(doc_dir):
            rel = path[len(doc_dir):]
            source = REPO / rel
            assert source.is_file(), f"{path}: no {source} in the tree"
            tree[path] = source
    return tree


def test_both_packages_install_the_docs_as_they_are_in_the_tree() -> None:
    # README.md, docs/ and examples/ side by side, as here, so relative links
    # hold; check-rpm-spec holds the RPM's %doc to the Debian lists, and
    # test_deb.py the built package to its place.
    debian = REPO / "packaging" / "debian"
    assert (debian / "cni-agent.docs").read_text().split() == ["README.md", "SECURITY.md", "docs"]
    assert (debian / "cni-agent.examples").read_text().split() == ["examples/*"]
    spec = (REPO / "packaging" / "rpm" / "cni-agent.spec").read_text()
    assert re.findall(r"^%doc (\S+)$", spec, re.M) == ["README.md", "SECURITY.md", "docs",
                                                         "examples"]
    tree = installed_tree()
    for page in [README, REPO / "SECURITY.md", *pages()]:
        assert f"/usr/share/doc/cni-agent/{page.relative_to(REPO)}" in tree, page


def test_every_relative_link_of_the_installed_docs_resolves_inside_the_package() -> None:
    tree = installed_tree()
    installed = set(tree)
    checked = 0
    for path, source in sorted(tree.items()):
        if source.suffix != ".md":
            continue
        for target in links(source.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            rel = target.partition("#")[0]
            if not rel:
                continue
            dest = os.path.normpath(os.path.join(os.path.dirname(path), rel))
            assert dest in installed or any(f.startswith(dest + "/") for f in installed), \
                f"{path}: link to {target}: {dest} is not in the package"
            checked += 1
    assert checked >= 100, checked


# --- the D-Bus reference against the XML -------------------------------------------


def xml_interface() -> ET.Element:
    iface = ET.parse(XML).getroot().find("interface")
    assert iface is not None
    return iface


def xml_signature(el: ET.Element) -> tuple[list[tuple[str, str]], list[str]]:
    """(type, name) of the in-arguments (a signal's: all), and the out types."""
    args = el.findall("arg")
    if el.tag == "signal":
        return [(a.get("type", ""), a.get("name", "")) for a in args], []
    ins = [(a.get("type", ""), a.get("name", "")) for a in args if a.get("direction") == "in"]
    return ins, [a.get("type", "") for a in args if a.get("direction") == "out"]


def xml_errors() -> list[str]:
    """The error names the XML's header comment documents."""
    raw = XML.read_text()
    block = raw[raw.index("Errors (org.cniagent.Agent1.Error.<Name>)"):]
    block = block[: block.index("-->")]
    return re.findall(r"^    ([A-Z][A-Za-z]+)\s{2,}", block, re.M)


def page_members(kind: str) -> dict[str, tuple[list[tuple[str, str]], list[str]]]:
    """The page's methods or signals: `### \\`Name(t a, t b) → t out, t out2\\``."""
    body = section(text("dbus-api.md"), kind)
    found = {}
    # Greedy: a struct's type (SandboxChanged's a(ssssas)) has parentheses of its own.
    for m in re.finditer(r"^### `(\w+)\((.*)\)(?: → ([^`]+))?`$", body, re.M):
        ins = [tuple(a.split()) for a in m.group(2).split(", ") if a]
        outs = [o.split()[0] for o in m.group(3).split(", ")] if m.group(3) else []
        assert all(len(a) == 2 for a in ins), m.group(0)
        found[m.group(1)] = ([(t, n) for t, n in ins], outs)
    return found


@pytest.mark.parametrize("kind", ["method", "signal"])
def test_the_dbus_page_names_exactly_the_xmls_methods_and_signals(kind: str) -> None:
    xml = {el.get("name", ""): xml_signature(el) for el in xml_interface().iter(kind)}
    page = page_members("Methods" if kind == "method" else "Signals")
    assert sorted(page) == sorted(xml), f"{kind}s: page {sorted(page)} vs XML {sorted(xml)}"
    for name, sig in xml.items():
        assert page[name] == sig, f"{kind} {name}: page {page[name]} vs XML {sig}"


def test_the_dbus_page_names_exactly_the_xmls_properties() -> None:
    xml = {el.get("name"): el.get("type") for el in xml_interface().iter("property")}
    table = next(t for t in tables(section(text("dbus-api.md"), "Properties")))
    page = {code_spans(n)[0]: code_spans(t)[0] for n, t, _ in table.rows}
    assert page == xml


def test_the_dbus_page_names_exactly_the_xmls_errors() -> None:
    table = next(t for t in tables(section(text("dbus-api.md"), "Errors")))
    page = [code_spans(cell)[0] for cell in table.column("error")]
    assert sorted(page) == sorted(xml_errors()) == sorted(k.value for k in ErrorKind)


# --- configuration -------------------------------------------------------------------


def flatten(doc: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in doc.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def test_the_configuration_page_gives_every_key_with_the_agents_default() -> None:
    code = dict(config_defaults())
    page = text("configuration.md")
    block = re.search(r"The keys, with their defaults:\n\n```yaml\n(.*?)```", page, re.S)
    assert block is not None
    assert dict(flatten(yaml.safe_load(block.group(1)))) == code
    assert documented_defaults(page) == code


# --- the CLI ---------------------------------------------------------------------------


def test_the_cli_page_names_every_command_and_option() -> None:
    page = text("cli.md")
    rows = " ".join(next(t for t in tables(page) if t.header == ("command", "does")).column(
        "command"))
    for name, sub in commands(build_parser()):
        if sub._subparsers is not None and name in ("config", "sandbox"):
            continue  # a group: its commands are checked
        assert f"`cni-agent {name}" in rows, f"cni-agent {name} is not in docs/cli.md's table"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in page, f"cni-agent {name} {flag} is not in docs/cli.md"
    assert "`cni-agent --version`" in rows and "--bus" in page


def test_the_cli_page_gives_every_exit_status() -> None:
    table = next(t for t in tables(section(text("cli.md"), "Exit status")))
    assert {int(s) for s in table.column("status")} == exit_statuses()


# --- troubleshooting ---------------------------------------------------------------------


def quoted_messages() -> list[str]:
    """Every message in a "Message" column of the troubleshooting page."""
    found = []
    for table in tables(text("troubleshooting.md")):
        if "Message" in table.header:
            found += [m for cell in table.column("Message") for m in code_spans(cell)]
    return found


def test_the_troubleshooting_page_covers_each_symptom() -> None:
    page = without_code_blocks(text("troubleshooting.md"))
    for symptom in ("NetworkReady is false", "A pod without an address",
                    "An IP that stays allocated", "Drift reported", "AccessDenied", "Busy",
                    "StateError", "The shim's CNI codes in a runtime's log",
                    "NetworkReady flaps", "The agent keeps restarting", "A node without an agent",
                    "The agent is not running"):
        assert re.search(rf"^## {re.escape(symptom)}$", page, re.M), symptom
    for word in ("cni-agent status", "cni-agent show", "cni-agent check", "cni-agent state",
                 "cni-agent config check", "SANDBOX_ID=", "NETWORK=", "PLUGIN="):
        assert word in page, word
    states = next(t for t in tables(page) if t.header[0] == "state").column("state")
    assert [code_spans(s)[0] for s in states] == [
        "ok", "drifted", "unsupported", "disabled", "failed-to-run", "repaired-with-new-address",
        "lost", "unchecked"]
    assert len(quoted_messages()) >= 80


def test_every_message_the_troubleshooting_page_quotes_is_one_the_agent_prints() -> None:
    unknown = [(m, part) for m in quoted_messages() for part in fixed_parts(m) if not printed(part)]
    assert not unknown, "quoted, but printed by nothing in agent/ or shim/:\n" + "\n".join(
        f"  {m!r}: {part!r}" for m, part in unknown)


def test_the_message_check_tells_a_real_message_from_a_reworded_one() -> None:
    # The check itself must be able to fail: a word changed is not the agent's text.
    assert printed("cni-agent went away during the call: see journalctl -u cni-agent")
    assert not printed("cni-agent went away while calling: see journalctl -u cni-agent")
    assert printed("is busy: lock not acquired within")
    assert not printed("is busy: lock not taken within")
    # Across a hole the code fills with another literal (`how`, then ": IPs").
    assert printed("repaired (DEL, then ADD with its recorded args and capabilities): IPs")


# --- runtimes and monitoring ------------------------------------------------------------------


def test_the_runtimes_page_shows_the_crio_drop_in_shim_config_prints() -> None:
    out = subprocess.run([sys.executable, "-m", "cni_agent", "shim-config", "--runtime", "crio",
                          "--drop-in"], capture_output=True, text=True, check=True).stdout
    block = re.search(r"```toml\n(.*?)```", section(text("runtimes.md"), "CRI-O"), re.S)
    assert block is not None and block.group(1) == out


def test_the_monitoring_page_names_every_metric_and_every_shipped_alert() -> None:
    page = text("monitoring.md")
    exported = {fam.name + ("_total" if fam.type == "counter" else "")
                for fam in Metrics().registry.collect() if fam.name.startswith("cni_agent_")}
    assert len(exported) >= 15
    missing = sorted(n for n in exported if n not in page)
    assert not missing, f"metrics not in docs/monitoring.md: {missing}"
    rules = yaml.safe_load((REPO / "packaging" / "monitoring" / "cni-agent-alerts.yml").read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert alerts and all(f"`{a}`" in page for a in alerts)


# --- the README's first pod, on a real agent -----------------------------------------------------


def walkthrough() -> list[tuple[str, list[str]]]:
    """The README's "First pod" console: (command, the lines it prints)."""
    block = re.search(r"```console\n(.*?)```", section(README.read_text(), "First pod"), re.S)
    assert block is not None
    steps: list[tuple[str, list[str]]] = []
    lines = iter(block.group(1).splitlines())
    for line in lines:
        if line.startswith("# "):
            command = line[2:]
            if "<<'EOF'" in command:  # a here-document: up to its EOF line
                for more in lines:
                    command += "\n" + more
                    if more == "EOF":
                        break
            steps.append((command, []))
        else:
            steps[-1][1].append(line)
    return steps


@pytest.mark.root
def test_the_readmes_first_pod_works_on_a_real_agent(tmp_path: Path) -> None:
    steps = walkthrough()
    assert 5 <= len(steps) and sum(c.count("\n") + 1 for c, _ in steps) <= 12
    # Unique names for what is shared on the host (bridge, netns, host-local's
    # directory); the agent's conf_dir for /etc/cni/net.d.
    bus = Bus("system")
    agent = Agent(tmp_path, bus)
    names = {"/etc/cni/net.d/": f"{agent.conf_dir}/", "pod1": unique_name("fp"),
             "cni0": unique_name("fpbr"), '"pods"': f'"{unique_name("fpnet")}"'}
    names["pods  "] = names['"pods"'].strip('"') + "  "

    def local(s: str) -> str:
        for old, new in names.items():
            s = s.replace(old, new)
        return s

    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": bus.address,
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    agent.conf_dir.mkdir(parents=True)
    try:
        agent.start()
        for command, expected in steps:
            run = subprocess.run(["bash", "-c", local(command)], capture_output=True, text=True,
                                 env=env, timeout=60)
            assert run.returncode == 0, f"{command}: {run.stderr}\n{agent.log()[-2000:]}"
            assert run.stdout.splitlines() == [local(e) for e in expected], command
    finally:
        subprocess.run(["cni-agent", "teardown", names["pod1"]], env=env, capture_output=True)
        subprocess.run(["ip", "netns", "del", names["pod1"]], capture_output=True)
        subprocess.run(["ip", "link", "del", names["cni0"]], capture_output=True)
        agent.stop()
        bus.stop()


# --- who refused: the bus policy lets every call through, the agent decides ------------------

POLICY = REPO / "dbus" / "org.cniagent.Agent1.conf"
# What the pages said before the bus policy left every decision to the agent.
STALE_POLICY_CLAIMS = re.compile(
    r"allows this only to root and|group `cni-agent` may call the interface|"
    r"run the runtime as root or as a member", re.I)


def test_what_the_pages_say_of_the_bus_policy_is_what_it_allows() -> None:
    policies = ET.parse(POLICY).getroot().findall("policy")
    assert [p.attrib for p in policies] == [{"user": "root"}, {"context": "default"}], \
        "the policy grants a group something: the pages say it grants no one more than another"
    default = next(p for p in policies if p.get("context") == "default")
    assert {"send_destination": "org.cniagent.Agent1", "send_interface": "org.cniagent.Agent1"} \
        in [a.attrib for a in default.findall("allow")], "the default context reaches the interface"
    row = next(r for t in tables(README.read_text()) if t.header == ("file", "what")
               for r in t.rows if "org.cniagent.Agent1.conf" in r[0])
    assert "every caller may reach the interface" in row[1] and "the agent decides" in row[1]
    sources = [README, *pages(), *sorted((REPO / "docs" / "man").glob("*.rst")),
               *sorted((REPO / "agent").rglob("*.py")), *sorted((REPO / "shim").glob("*.c"))]
    stale = [str(p.relative_to(REPO)) for p in sources if STALE_POLICY_CLAIMS.search(p.read_text())]
    assert not stale, f"still say the bus policy admits only root and the group: {stale}"


def deny_locally(tmp_path: Path, *members: str) -> Path:
    """The shipped policy plus an admin's local rule denying `members` to everyone."""
    rules = "".join('<deny send_destination="org.cniagent.Agent1" '
                    f'send_interface="org.cniagent.Agent1" send_member="{m}"/>' for m in members)
    text = POLICY.read_text().replace(
        "</busconfig>", f'<policy context="default">{rules}</policy>\n</busconfig>')
    path = tmp_path / "local-policy.conf"
    path.write_text(text)
    path.chmod(0o644)
    return path


def troubleshooting_says(message: str) -> None:
    """`message` is one of the AccessDenied section's quoted messages, as printed."""
    quoted = [code_spans(cell)[0] for t in tables(section(text("troubleshooting.md"),
                                                          "AccessDenied"))
              for cell in t.column("Message")]
    assert any(all(part in message for part in fixed_parts(q)) for q in quoted), \
        f"docs/troubleshooting.md's AccessDenied section quotes nothing like {message!r}"


@pytest.mark.root
def test_an_access_denied_says_what_refused_the_caller(tmp_path: Path, netns: str) -> None:
    """The agent's refusal names its rule, the bus daemon's says the agent never saw the call;
    both as docs/troubleshooting.md quotes them, from the CLI and from the shim."""
    from tests.support.agent import as_user_python
    from tests.support.shim import readable_shim, run_shim, shim_conf

    shim = readable_shim()
    for local_rule in (False, True):
        bus = Bus("system", policy_file=deny_locally(tmp_path, "Setup", "CNICall")
                  if local_rule else POLICY)
        agent = Agent(tmp_path / str(local_rule), bus)
        agent.conf_dir.mkdir(parents=True)
        try:
            agent.start()
            cli = subprocess.run([*as_user_python("nobody"), "--bus", bus.address, "setup", "x",
                                  netns], capture_output=True, text=True, timeout=60)
            add = run_shim(bus.address, "ADD", shim_conf("pods"), cid="c", netns=netns,
                           user="nobody", binary=shim, socket=str(tmp_path / "absent"))
        finally:
            agent.stop()
            bus.stop()
        assert cli.returncode == 4, cli.stderr
        assert add.code == 999, add
        if local_rule:
            assert "Rejected send message" in cli.stderr and \
                "refused by the D-Bus daemon's policy, before cni-agent saw the call" in cli.stderr
            assert add.out["msg"].startswith("access denied by the D-Bus daemon's policy"), add
        else:
            assert cli.stderr == ("cni-agent: access denied: Setup requires root or membership "
                                  "in the cni-agent group (caller uid 65534)\n")
            assert add.out["msg"] == ("access denied by cni-agent: CNICall is for runtimes "
                                      "running as root; use Setup or Attach with netns_fd")
        troubleshooting_says(cli.stderr.strip())
        troubleshooting_says(add.out["msg"])


# --- runtimes: every version a node runs ----------------------------------------------------


def test_the_runtimes_page_says_up_front_that_podman_5_has_no_cni_backend() -> None:
    page = text("runtimes.md")
    intro = page[:page.index("\n## ")]
    assert "**podman 5 has no CNI backend**" in intro
    err = subprocess.run([sys.executable, "-m", "cni_agent", "shim-config", "--runtime", "podman"],
                         capture_output=True, text=True, check=True).stderr
    assert "podman 5 has no CNI backend" in err and "--network ns:/run/netns/NAME" in err
    from cni_agent.cli.shim_config import RUNTIMES_DOC
    assert RUNTIMES_DOC in err and RUNTIMES_DOC in installed_tree()  # where both packages put it


def test_the_version_matrix_covers_every_version_and_what_the_tests_run() -> None:
    page = section(text("runtimes.md"), "Versions")
    runtimes, plugins = [t for t in tables(page)][:2]
    rows = {r[0]: r for r in runtimes.rows}
    assert list(rows) == [
        "containerd 1.6, 1.7", "containerd 2.0", "containerd 2.1 and later", "CRI-O 1.30",
        "CRI-O 1.31", "CRI-O 1.32 – 1.35", "CRI-O 1.36.0 – 1.36.2", "CRI-O 1.36.3 – 1.37",
        "podman 4 (CNI backend)", "podman 5"]
    assert [r[0] for r in plugins.rows] == ["1.1 – 1.4", "1.5 – 1.9"]
    tested = dict(zip(runtimes.column("runtime"), runtimes.column("tested here"), strict=True))
    untested = [name for name, cell in tested.items() if re.match(r"no\b", cell)]
    # Versions no test here runs say so.
    assert untested == ["containerd 1.6, 1.7", "containerd 2.0", "CRI-O 1.30", "CRI-O 1.31",
                        "CRI-O 1.32 – 1.35", "CRI-O 1.36.0 – 1.36.2"], untested
    # What this machine's tests run is what the table says they run.
    containerd = subprocess.run(
        ["/var/cache/cni-agent-tests/containerd/usr/bin/containerd", "--version"],
        capture_output=True, text=True, check=True).stdout.split()[2]
    assert containerd.startswith("2.") and int(containerd.split(".")[1]) >= 1
    assert tested["containerd 2.1 and later"].startswith(containerd.rsplit(".", 1)[0])
    podman = subprocess.run(["podman", "--version"], capture_output=True, text=True,
                            check=True).stdout.split()[-1]
    assert podman.startswith("4.") and podman in tested["podman 4 (CNI backend)"]
    debian = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "containernetworking-plugins"],
                            capture_output=True, text=True, check=True).stdout.split("+")[0]
    assert plugins.rows[0][3].startswith(f"{debian} (Debian 12)")
    newer = Path("/var/cache/cni-agent-tests/cni-plugins-1.9.1")
    assert newer.is_dir() and plugins.rows[1][3].startswith("1.9.1")
    # CRI-O runs only under make test-crio: the table says so.
    assert "not part of `make test`" in tested["CRI-O 1.36.3 – 1.37"]


def test_the_monitoring_page_probes_what_the_agent_serves_and_no_pod() -> None:
    """The agent runs as a host service (host netns, /run, the system bus): no
    page offers it as a pod, and the probes it gives are paths the agent serves."""
    page = text("monitoring.md")
    assert "readinessProbe" not in page and "livenessProbe" not in page
    for doc in [README, *pages()]:
        for m in re.finditer(r"(\w+ )?as a pod", without_code_blocks(doc.read_text())):
            assert m.group(1) == "not ", f"{doc.name}: {m.group(0)!r}"
    served = set(re.findall(r'add_get\("(/\w+)"',
                            (REPO / "agent" / "cni_agent" / "service" / "httpd.py").read_text()))
    probed = re.findall(r"curl -fsS http://[\d.]+:\d+(/\w+)", page)
    assert probed and set(probed) <= served, (probed, served)


# --- the compatibility policy quotes the code's figures -------------------------------------


def test_the_compatibility_page_quotes_the_codes_figures(tmp_path: Path) -> None:
    from cni_agent.api import INTERFACE_REVISION
    from cni_agent.service.callers import invalid
    from cni_agent.service.shimsock import MAGIC

    page = " ".join(text("compatibility.md").split())
    assert f"`InterfaceRevision` ({INTERFACE_REVISION} in this release)" in page
    statuses = section(text("compatibility.md"), "The command line")
    assert {int(n) for n in re.findall(r"\b(\d+) [a-z]", statuses.split("(")[0])} == \
        exit_statuses()
    shim = (REPO / "shim" / "cni-agent-shim.c").read_text()
    versions = re.findall(r'\\"([\d.]+)\\"', re.search(r"#define SUPPORTED_VERSIONS (.+)",
                                                       shim).group(1))  # type: ignore[union-attr]
    assert f"spec versions {versions[0]} to {versions[-1]}" in page
    assert f'#define SOCKET_MAGIC "{MAGIC.decode()}"' in shim and f"`{MAGIC.decode()}`" in page
    # An unknown options key and an unknown configuration key are refused by name.
    assert str(invalid("options", "unknown key 'x'")).startswith("options: unknown key")
    assert "`InvalidArgument: options: unknown key …`" in page
    bad = tmp_path / "agent.yaml"
    bad.write_text("gc: {intervall: 5}\n")
    check = subprocess.run([sys.executable, "-m", "cni_agent", "config", "check", "--config",
                            str(bad)], capture_output=True, text=True)
    assert check.returncode == 2 and "gc.intervall: unknown key" in check.stdout + check.stderr
    assert "start-up stops (exit status 2)" in page


def test_the_xml_says_whose_cnicall_commands_are_whose() -> None:
    from cni_agent.sandboxes.policy import Scope, cnicall_scope

    raw = XML.read_text()
    comment = raw[:raw.index('<method name="CNICall">')].rsplit("<!--", 1)[1]
    comment = " ".join(comment.split())
    assert "STATUS and VERSION are open to anyone; ADD, DEL, CHECK and GC are root's" in comment
    assert {c: cnicall_scope(c) for c in ("STATUS", "VERSION", "ADD", "DEL", "CHECK", "GC")} == {
        "STATUS": Scope.OPEN, "VERSION": Scope.OPEN, "ADD": Scope.RUNTIME, "DEL": Scope.RUNTIME,
        "CHECK": Scope.RUNTIME, "GC": Scope.RUNTIME}
