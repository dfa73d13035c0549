"""examples/: the files the documentation uses, each one checked against what
the code does with it. The agent's networks load as the agent loads them
(`cni-agent config check`), its configuration snippets load with the values
they say, every runtime-side shim conflist (and CRI-O's drop-in) is exactly
what `cni-agent shim-config` prints for it, containerd reads each config
snippet as naming the shim's directory, and every example is shown by a page
exactly as it is on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cni_agent.config import AgentConfig
from tests.support.docs import README, REPO, links, pages

EXAMPLES = REPO / "examples"
NETWORKS = EXAMPLES / "agent" / "net.d"
SNIPPETS = EXAMPLES / "agent" / "agent.yaml.d"
RUNTIME = EXAMPLES / "runtime"
CONTAINERD = Path(os.environ.get("CNI_AGENT_TEST_CACHE", "/var/cache/cni-agent-tests")) / \
    "containerd" / "usr" / "bin" / "containerd"
DEBIAN_PLUGINS = "/usr/lib/cni"

# Each runtime-side file: the `cni-agent shim-config` arguments that print it
# (with --config naming a configuration whose conf_dir is examples/agent/net.d).
SHIM_CONFIG = {
    "containerd/10-pods.conflist": ["--runtime", "containerd", "--network", "podnet",
                                    "--name", "pods"],
    "containerd-1.x/10-pods.conflist": ["--runtime", "containerd", "--cni-version", "1.0.0",
                                        "--network", "podnet", "--name", "pods"],
    "crio/10-pods.conflist": ["--runtime", "crio", "--network", "podnet", "--name", "pods"],
    "crio/10-cni-agent.conf": ["--runtime", "crio", "--drop-in"],
    "podman/10-pods.conflist": ["--runtime", "podman", "--network", "podnet", "--name", "pods"],
}
# containerd's config snippets: (file, the CRI plugin's table, its plugin-dir key, config version).
CONTAINERD_SNIPPETS = [
    ("containerd/config-2.1.toml", "io.containerd.cri.v1.runtime", "bin_dirs", 3),
    ("containerd/config-2.0.toml", "io.containerd.cri.v1.runtime", "bin_dir", 3),
    ("containerd-1.x/config.toml", "io.containerd.grpc.v1.cri", "bin_dir", 2),
]


def cni_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cni_agent", *args], capture_output=True,
                          text=True, timeout=60)


def agent_config(tmp_path: Path, *dropins: Path, **keys: Any) -> Path:
    """A configuration file (and FILE.d/ with `dropins`) for `--config`."""
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({"conf_dir": str(NETWORKS),
                                      "plugin_dirs": [DEBIAN_PLUGINS], **keys}))
    d = tmp_path / "agent.yaml.d"
    d.mkdir(exist_ok=True)
    for f in dropins:
        shutil.copy(f, d / f.name)
    return config


def test_every_agent_network_loads_as_the_agent_loads_it(tmp_path: Path) -> None:
    names = sorted(json.loads(f.read_text())["name"] for f in NETWORKS.glob("*.conflist"))
    assert names == ["podnet", "vmnet"]
    # With the snippet that opens vmnet to members: check also holds an opened
    # network to anti-spoofing (vmnet is a bridge network, so nothing to say).
    check = cni_agent("config", "check", "--config",
                      str(agent_config(tmp_path, SNIPPETS / "60-vmm.yaml")))
    assert check.returncode == 0, check.stdout + check.stderr
    [line] = check.stdout.splitlines()
    assert line.startswith("ok: ") and f"networks in {NETWORKS}: podnet, vmnet" in line, line


@pytest.mark.parametrize("snippet", sorted(p.name for p in SNIPPETS.glob("*.yaml")))
def test_every_configuration_snippet_loads_with_the_values_it_says(tmp_path: Path,
                                                                   snippet: str) -> None:
    path = SNIPPETS / snippet
    shown = cni_agent("config", "show", "--json", "--config", str(agent_config(tmp_path, path)))
    assert shown.returncode == 0, shown.stderr
    merged = json.loads(shown.stdout)
    assert merged["files"][-1].endswith(f"agent.yaml.d/{snippet}")

    def within(said: dict[str, Any], got: dict[str, Any]) -> None:
        for key, value in said.items():
            if isinstance(value, dict):
                within(value, got[key])
            else:
                assert got[key] == value, (snippet, key)

    within(yaml.safe_load(path.read_text()), merged["config"])


def test_every_runtime_file_is_what_shim_config_prints(tmp_path: Path) -> None:
    on_disk = sorted(str(p.relative_to(RUNTIME)) for p in RUNTIME.rglob("*")
                     if p.suffix in (".conflist", ".conf"))
    assert on_disk == sorted(SHIM_CONFIG), "a runtime-side file shim-config does not print"
    config = agent_config(tmp_path)
    for name, argv in SHIM_CONFIG.items():
        out = cni_agent("shim-config", *argv, "--config", str(config))
        assert out.returncode == 0, out.stderr
        assert (RUNTIME / name).read_text() == out.stdout, \
            f"examples/runtime/{name} is not what `cni-agent shim-config {' '.join(argv)}` prints"


@pytest.mark.parametrize(("name", "table", "key", "version"), CONTAINERD_SNIPPETS)
def test_each_containerd_snippet_names_the_shims_directory_as_containerd_reads_it(
        name: str, table: str, key: str, version: int) -> None:
    raw = tomllib.loads((RUNTIME / name).read_text())
    assert raw["version"] == version
    cni = raw["plugins"][table]["cni"]
    assert set(cni) == {key, "conf_dir"} and cni["conf_dir"] == "/etc/cni/net.d"
    assert isinstance(cni[key], list if key == "bin_dirs" else str)
    # containerd 2.1 (Debian unstable, `make setup`) reads all three: it
    # migrates version 2 and 2.0's bin_dir, so each names the directory the
    # shim is in, and the conf dir the shim's conflist goes to.
    dumped = subprocess.run([str(CONTAINERD), "--config", str(RUNTIME / name), "config", "dump"],
                            capture_output=True, text=True, timeout=60)
    assert dumped.returncode == 0, dumped.stderr
    read = tomllib.loads(dumped.stdout)["plugins"]["io.containerd.cri.v1.runtime"]["cni"]
    assert DEBIAN_PLUGINS in read["bin_dirs"] and read["conf_dir"] == "/etc/cni/net.d", read


# --- the pages show the examples as they are ----------------------------------------------


def documents() -> list[Path]:
    return [README, *pages()]


def example_links(doc: Path) -> set[Path]:
    return {(doc.parent / t.partition("#")[0]).resolve() for t in links(doc.read_text())
            if "examples/" in t}


def test_every_example_is_used_by_a_page() -> None:
    linked = set().union(*(example_links(d) for d in documents()))
    files = {p.resolve() for p in EXAMPLES.rglob("*") if p.is_file()}
    unused = sorted(str(p.relative_to(REPO)) for p in files - linked)
    assert not unused, f"examples no page links to: {unused}"
    assert linked <= files, sorted(str(p) for p in linked - files)


def shown_examples(doc: Path) -> list[tuple[Path, str]]:
    """(example, block) for each fenced block but a console whose paragraph just
    before it links an example first: the block shows that file."""
    lines = doc.read_text().splitlines(keepends=True)
    found = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        para_end = i - 1
        while para_end >= 0 and not lines[para_end].strip():
            para_end -= 1
        para_start = para_end
        while para_start > 0 and lines[para_start - 1].strip():
            para_start -= 1
        first = re.search(r"\]\(([^)\s]*examples/[^)\s]+)\)", "".join(lines[para_start:para_end + 1]))
        if first and para_end >= 0 and not lines[i].startswith("```console"):
            found.append(((doc.parent / first.group(1)).resolve(), "".join(lines[i + 1:end])))
        i = end + 1
    return found


def console_cats(doc: Path) -> list[tuple[str, str]]:
    """(path, output) of each `# cat PATH` in the page's console blocks."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", doc.read_text(), re.S):
        for m in re.finditer(r"^# cat (\S+)\n((?:(?![#$] ).*\n)*)", block, re.M):
            found.append((m.group(1), m.group(2)))
    return found


def test_every_example_a_page_shows_is_shown_as_it_is() -> None:
    shown = [(doc, ex, block) for doc in documents() for ex, block in shown_examples(doc)]
    assert len(shown) >= 9
    for doc, example, block in shown:
        assert block == example.read_text(), \
            f"{doc.name} shows {example.relative_to(REPO)} otherwise than it is"
    cats = [(doc, path, out) for doc in documents() for path, out in console_cats(doc)]
    assert any(doc.name == "security.md" for doc, _, _ in cats)
    by_name = {p.name: p for p in (EXAMPLES / "agent").rglob("*") if p.is_file()}
    for doc, path, out in cats:
        example = by_name.get(Path(path).name)
        if example is not None:
            assert out == example.read_text(), f"{doc.name}: `cat {path}` is not {example}"


def test_a_page_puts_the_agents_networks_where_its_conf_dir_is() -> None:
    """An agent network a page shows is in the default conf_dir, or in the
    agent's own directory only where the page sets `conf_dir` to it (as
    runtimes.md's two conf dirs do)."""
    default = AgentConfig().conf_dir
    assert default == "/etc/cni/net.d"
    own = yaml.safe_load((SNIPPETS / "10-own-conf-dir.yaml").read_text())["conf_dir"]
    networks = {p.name for p in NETWORKS.iterdir()}
    shown = 0
    for doc in documents():
        text = doc.read_text()
        allowed = {default} | ({own} if f"conf_dir: {own}" in text else set())
        for path, _ in console_cats(doc):
            if Path(path).name in networks:
                shown += 1
                assert str(Path(path).parent) in allowed, \
                    f"{doc.name}: {path} is not in the agent's conf_dir ({default})"
    assert shown >= 1


def test_every_conflist_a_page_names_is_an_example_or_one_it_writes() -> None:
    """No page tells the reader to copy a file nothing ships (runtimes.md once
    named a 10-bridge-firewalld.conflist)."""
    examples = {p.name for p in EXAMPLES.rglob("*.conflist")}
    for doc in [*documents(), *sorted((REPO / "docs" / "man").glob("*.rst"))]:
        text = doc.read_text()
        written = set(re.findall(r">\s*\\?\s*(?:/[\w.-]+)*/([\w.-]+\.conflist)", text))
        for name in set(re.findall(r"[\w.-]+\.conflist", text)):
            assert name in examples | written, \
                f"{doc.name} names {name}, which is no example and which it does not write"
