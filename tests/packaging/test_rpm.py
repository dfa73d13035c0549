"""The RPM spec's dependencies are names Fedora has (packaging/rpm/fedora-packages.tsv),
and every Python dependency of pyproject.toml is required by what Fedora provides."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
