"""The man pages build without a warning, render without one, name
everything there is (every CLI command and option, config key and D-Bus
member), and say the same as docs/: every key with the same default as
docs/configuration.md and the code, the same commands and exit statuses as
docs/cli.md, the same members and errors as docs/dbus-api.md.

Built with the distribution's docutils (tools/build-man), as the packages do.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cni_agent.api import ErrorKind
from cni_agent.cli.commands import build_parser
from cni_agent.config import AgentConfig
from tests.support.docs import (
    code_spans,
    commands,
    config_defaults,
    documented_defaults,
    exit_statuses,
    section,
    tables,
)

REPO = Path(__file__).resolve().parents[2]
MAN = REPO / "docs" / "man"
PAGES = ("cni-agent.8", "cni-agent.yaml.5", "org.cniagent.Agent1.5", "cni-agent-shim.8",
         "cni-sandbox@.service.8")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("man")
    run = subprocess.run(["/usr/bin/python3", str(REPO / "tools" / "build-man"), str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return out


def source(page: str) -> str:
    return (MAN / f"{page}.rst").read_text()


@pytest.mark.parametrize("page", PAGES)
def test_each_page_renders_without_a_warning(built: Path, page: str) -> None:
    out = subprocess.run(["man", "--warnings", "-l", str(built / page)], capture_output=True,
                         text=True, env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
    assert out.returncode == 0 and out.stderr == "", out.stderr
    name = page.rsplit(".", 1)[0]
    assert out.stdout.startswith(f"{name.upper()}({page.rsplit('.', 1)[1]})"), out.stdout[:80]


def test_cni_agent_8_names_every_command_and_option() -> None:
    text = source("cni-agent.8")
    for name, sub in commands(build_parser()):
        assert f"**{name}**" in text, f"command {name!r} is not in cni-agent(8)"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"**{flag}**" in text, f"{name} {flag} is not in cni-agent(8)"


def config_keys(cls: type, prefix: str = "") -> Iterator[str]:
    for f in dataclasses.fields(cls):
        if f.name in ("source", "sources", "origins"):
            continue  # where it was read from, not a key
        key = "del" if f.name == "delete" else f.name  # `del` is a Python keyword
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            yield from config_keys(f.default_factory, f"{prefix}{key}.")  # type: ignore[arg-type]
        else:
            yield prefix + key


def test_cni_agent_yaml_5_names_every_key() -> None:
    text = source("cni-agent.yaml.5")
    keys = list(config_keys(AgentConfig))
    assert "timeouts.del" in keys and "gc.interval" in keys
    missing = [k for k in keys if f"``{k}``" not in text]
    assert not missing, f"keys not in cni-agent.yaml(5): {missing}"


def test_org_cniagent_agent1_5_names_every_member_and_error() -> None:
    text = source("org.cniagent.Agent1.5")
    iface = ET.parse(REPO / "dbus" / "org.cniagent.Agent1.xml").getroot().find("interface")
    assert iface is not None
    for kind in ("method", "property", "signal"):
        for el in iface.iter(kind):
            assert re.search(rf"^\*\*{el.get('name')}\*\* \(", text, re.M), \
                f"{kind} {el.get('name')} is not in org.cniagent.Agent1(5)"
    for kind in ErrorKind:
        assert f"**{kind.value}**" in text, f"error {kind.value} is not in org.cniagent.Agent1(5)"


COMPLETION = REPO / "packaging" / "completion" / "cni-agent"
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")


def test_the_bash_completion_knows_every_command_and_option() -> None:
    text = COMPLETION.read_text()
    words = set(re.findall(r"[\w-]+", text))
    for name, sub in commands(build_parser()):
        assert name.split()[-1] in words, f"command {name!r} is not completed"
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--"):
                    assert flag in words, f"{name} {flag} is not completed"


def complete(*words: str) -> list[str]:
    """What bash completes for `words` (the last one being typed), with the real
    bash-completion library loaded, as an interactive shell has it."""
    script = (f"source {BASH_COMPLETION}; source {COMPLETION}; "
              'COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); '
              'COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; _cni_agent; '
              'printf "%s\\n" "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "-c", script, "bash", *words], capture_output=True,
                         text=True, check=True)
    return out.stdout.split()


def test_the_bash_completion_completes_in_a_real_bash() -> None:
    assert complete("cni-agent", "se") == ["setup"]
    assert "shim-config" in complete("cni-agent", "")
    assert complete("cni-agent", "setup", "--ne") == ["--network"]
    assert complete("cni-agent", "--bus", "session", "st") == ["status", "state"]
    assert complete("cni-agent", "config", "") == ["show", "check", "--help"]
    assert complete("cni-agent", "config", "show", "--j") == ["--json"]
    assert complete("cni-agent", "sandbox", "") == ["up", "down", "--help"]
    assert complete("cni-agent", "shim-config", "--runtime", "c") == ["containerd", "crio"]
    assert complete("cni-agent", "sandbox", "up", "web", "--d") == ["--dir"]


# --- the man pages say the same as docs/ --------------------------------------------------

DOCS = REPO / "docs"


def man_defaults() -> dict[str, object]:
    """cni-agent.yaml(5)'s keys and defaults: ``key`` (default ``VALUE``)."""
    found = re.findall(r"^``([\w.]+)`` \(default ``(.*?)``", source("cni-agent.yaml.5"), re.M)
    return {key: yaml.safe_load(value) for key, value in found}


def test_every_key_of_cni_agent_yaml_5_is_in_the_docs_with_the_same_default() -> None:
    man = man_defaults()
    docs = documented_defaults((DOCS / "configuration.md").read_text())
    code = dict(config_defaults())
    assert man == code, "cni-agent.yaml(5)'s keys and defaults are not the code's"
    assert docs == man, "docs/configuration.md's keys and defaults are not cni-agent.yaml(5)'s"


GROUPS = ("config", "sandbox")  # commands of commands: their own are what is described


def man_commands() -> set[str]:
    """The commands cni-agent(8) describes: each entry of COMMANDS, **name** …"""
    body = source("cni-agent.8").split("COMMANDS\n========", 1)[1].split("OPTIONS\n=======")[0]
    return {n for n in re.findall(r"^\*\*([a-z][a-z -]*)\*\*", body, re.M) if n not in GROUPS}


def docs_commands() -> set[str]:
    """The commands docs/cli.md's table describes: `cni-agent NAME …`."""
    page = (DOCS / "cli.md").read_text()
    out = set()
    for row in next(t for t in tables(page) if t.header == ("command", "does")).column("command"):
        words = code_spans(row)[0].split()[1:]
        if not words[0].startswith("-"):
            out.add(" ".join(words[:2]) if words[0] in GROUPS else words[0])
    return out


def man_exit_statuses() -> set[int]:
    body = source("cni-agent.8").split("EXIT STATUS\n===========", 1)[1].split("ENVIRONMENT")[0]
    return {int(s) for s in re.findall(r"^\*\*(\d+)\*\*$", body, re.M)}


def test_cni_agent_8_and_docs_cli_md_describe_the_same_commands_and_exit_statuses() -> None:
    parser = {name for name, _ in commands(build_parser()) if name not in GROUPS}
    assert man_commands() == docs_commands() == parser
    cli = (DOCS / "cli.md").read_text()
    table = next(tables(section(cli, "Exit status")))
    assert man_exit_statuses() == {int(s) for s in table.column("status")} == exit_statuses()


def test_org_cniagent_agent1_5_and_docs_dbus_api_md_name_the_same_members() -> None:
    man = source("org.cniagent.Agent1.5")
    page = (DOCS / "dbus-api.md").read_text()
    in_man = set(re.findall(r"^\*\*(\w+)\*\* \(", man, re.M))
    in_docs = set(re.findall(r"^### `(\w+)\(", page, re.M))
    in_docs |= {code_spans(r[0])[0] for r in next(tables(section(page, "Properties"))).rows}
    assert in_man == in_docs
    man_errors = {m for m in re.findall(r"^\*\*(\w+)\*\*$", man, re.M)}
    docs_errors = {code_spans(c)[0] for c in next(tables(section(page, "Errors"))).column("error")}
    assert man_errors == docs_errors == {k.value for k in ErrorKind}


# --- the shim's and the sandbox unit's pages say what they do -----------------------------

SHIM_SOURCE = REPO / "shim" / "cni-agent-shim.c"
SANDBOX_UNIT = REPO / "systemd" / "cni-sandbox@.service"


def c_define(name: str) -> str:
    m = re.search(rf"^#define {name} (.+)$", SHIM_SOURCE.read_text(), re.M)
    assert m is not None, name
    return m.group(1)


def test_cni_agent_shim_8_says_what_the_shim_does() -> None:
    text = " ".join(source("cni-agent-shim.8").split())
    versions = re.findall(r'\\"([\d.]+)\\"', c_define("SUPPORTED_VERSIONS"))
    assert versions and f"{', '.join(versions[:-1])} and {versions[-1]}" in text
    assert f"``{c_define('SOCKET_PATH').strip(chr(34))}``" in text
    assert f"``{c_define('SOCKET_ENV').strip(chr(34))}``" in text
    assert "``DBUS_SYSTEM_BUS_ADDRESS``" in text
    assert f"backstop timeout ({c_define('CALL_TIMEOUT_SEC').removesuffix('ULL')} s)" in text
    # The codes are those docs/runtimes.md gives a runtime's log.
    runtimes = (DOCS / "runtimes.md").read_text()
    documented = {int(c) for c in re.findall(r"→ (\d+)", section(runtimes, "Error codes"))}
    documented |= {int(c) for c in re.findall(r"code (\d+)", section(runtimes, "What each verb does"))}
    body = source("cni-agent-shim.8").split("EXIT STATUS\n===========", 1)[1].split("FILES\n")[0]
    assert {int(c) for c in re.findall(r"^\*\*(\d+)\*\*$", body, re.M)} == documented


def test_cni_sandbox_service_8_says_what_the_unit_does() -> None:
    from cni_agent.cli import sandbox

    text = " ".join(source("cni-sandbox@.service.8").split())
    unit = {k: v for k, _, v in (line.partition("=") for line in
                                 SANDBOX_UNIT.read_text().splitlines() if "=" in line)}
    for key in ("ExecStart", "ExecStopPost"):
        command = unit[key].replace("/usr/bin/", "").replace("%i", "NAME")
        assert f"``{command}``" in text, (key, command)
    for key in ("TimeoutStartSec", "TimeoutStopSec"):
        assert f"``{key}={unit[key]}``" in text, key
    assert f"``Requires=`` and is ordered ``After=`` ``{unit['Requires']}``" in text
    assert f"waits up to {sandbox.DEFAULT_TIMEOUT:g} s" in text and "--timeout 60" in unit["ExecStart"]
    assert f"``{sandbox.SANDBOX_DIR}/NAME.yaml``" in text
    body = source("cni-sandbox@.service.8").split("SANDBOX FILE\n", 1)[1].split("EXAMPLES\n")[0]
    assert tuple(re.findall(r"^``(\w+)``$", body, re.M)) == sandbox._KEYS
    assert "at most 63" in text and sandbox._NAME.pattern.endswith("{0,62}")
    # Its example file is the one docs/runtimes.md shows (examples/sandboxes/web.yaml).
    example = (REPO / "examples" / "sandboxes" / "web.yaml").read_text()
    assert "\n".join("    " + line for line in example.splitlines()) in source(
        "cni-sandbox@.service.8")
