"""The documentation says what the code does, and stays findable: the README's
map and docs/ in step, every link resolving, the D-Bus reference naming exactly
the XML's members, every configuration key with the agent's default, every
test a page cites existing, every message the troubleshooting page quotes one
the agent prints, and the README's first-pod walk-through working on a real
agent.
"""

from __future__ import annotations

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


def test_both_packages_install_every_page() -> None:
    # Next to the README they link to by name; check-rpm-spec holds the RPM's
    # %doc to the Debian list, test_deb.py the built package to its place.
    listed = (REPO / "packaging" / "debian" / "cni-agent.docs").read_text().split()
    assert listed == ["README.md", *(str(p.relative_to(REPO)) for p in pages())]
    spec = (REPO / "packaging" / "rpm" / "cni-agent.spec").read_text()
    assert re.findall(r"^%doc (\S+)$", spec, re.M) == listed


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
    block = re.search(r"```toml\n(.*?)```", text("runtimes.md"), re.S)
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
