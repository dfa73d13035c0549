"""The RPM spec's dependencies are names Fedora has (packaging/rpm/fedora-packages.tsv),
and every Python dependency of pyproject.toml is required by what Fedora provides; the
built RPM's documentation keeps its links."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from tests.support.docs import links

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "packaging" / "rpm" / "cni-agent.spec"
TABLE = ROOT / "packaging" / "rpm" / "fedora-packages.tsv"


def fedora_names() -> dict[str, str]:
    rows = {}
    for line in TABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, package, source = line.split("\t")
            assert source.strip(), f"{name}: a row names its source"
            rows[name] = package
    return rows


def spec_dependencies() -> dict[str, list[str]]:
    """Requires/BuildRequires/Recommends/Suggests of the spec as written, by tag
    (each comma- or space-separated name; version clauses dropped)."""
    deps: dict[str, list[str]] = {}
    for m in re.finditer(r"^(Requires|BuildRequires|Recommends|Suggests)(?:\([a-z,]+\))?:\s*(.+)$",
                         SPEC.read_text(), re.M):
        names = re.findall(r"[A-Za-z0-9_.+-]+(?:\([^)]*\))?", re.sub(r"[<>=]+\s*\S+", "", m[2]))
        deps.setdefault(m[1], []).extend(names)
    return deps


def test_every_dependency_of_the_spec_is_a_name_fedora_has() -> None:
    table = fedora_names()
    deps = spec_dependencies()
    assert deps["Requires"] and deps["BuildRequires"]
    unknown = sorted({n for names in deps.values() for n in names} - set(table))
    assert not unknown, f"not in {TABLE.name} (check Fedora, then add a row): {unknown}"
    # The name that broke every dnf install: Fedora's pyinotify is python3-inotify.
    assert "python3-pyinotify" not in SPEC.read_text()


def test_every_python_dependency_is_required_as_python3dist() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = set(spec_dependencies()["Requires"])
    for dep in project["dependencies"]:
        name = re.split(r"[\s;<>=!~\[]", dep, maxsplit=1)[0]
        normal = re.sub(r"[-_.]+", "-", name).lower()
        assert f"python3dist({normal})" in required, dep
    # Not as Fedora package names: those differ from the Python names (above).
    assert not [n for n in required if n.startswith("python3-")], required


def test_pyasyncore_only_where_python_lacks_asyncore() -> None:
    text = SPEC.read_text()
    block = re.search(r"^%if (.+)\n(?:#.*\n)*Requires:\s*python3dist\(pyasyncore\)\n%endif$", text, re.M)
    assert block, "python3dist(pyasyncore) under its own %if"
    assert block[1] == "0%{?python3_version_nodots} >= 312"


def test_every_relative_link_of_the_rpms_docs_resolves_inside_the_package(tmp_path: Path) -> None:
    """The RPM, built as `make rpm` builds it (from `git archive HEAD`: what is
    committed), installs README.md, docs/ and examples/ as in the tree, so the
    links between them hold."""
    build = subprocess.run([str(ROOT / "tools" / "build-rpm"), "rpm"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "CNI_AGENT_RPM_OUT": str(tmp_path / "out"),
                                "CNI_AGENT_RPM_WITHOUT_TESTS": "1"})
    assert build.returncode == 0, build.stderr
    [rpm] = [line for line in build.stdout.split()
             if re.search(r"/cni-agent-\d[^/]*\.(x86_64|aarch64)\.rpm$", line)]
    assert rpm.startswith("/"), rpm  # an out dir outside the tree is printed whole
    listed = subprocess.run(["rpm", "-qlp", rpm], capture_output=True, text=True,
                            check=True).stdout.split()
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(f"rpm2cpio {rpm} | cpio -idm --quiet", shell=True, cwd=root, check=True)
    doc_dir = root / "usr" / "share" / "doc" / "cni-agent"
    pages = sorted(doc_dir.rglob("*.md"))
    assert doc_dir / "README.md" in pages and doc_dir / "docs" / "runtimes.md" in pages
    checked = 0
    for page in pages:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            dest = Path(os.path.normpath(page.parent / target.partition("#")[0]))
            assert "/" + str(dest.relative_to(root)) in listed, \
                f"{page.relative_to(root)}: link to {target} is not in the package"
            checked += 1
    assert checked >= 100, checked
