"""Check packaging/rpm/cni-agent.spec for what rpmbuild and rpmlint cannot.

`make rpm-spec-check` (and tests/packaging/test_units.py). `make rpm` builds
the spec for one release and `make rpm-lint` lints the result, so these are
theirs, not this tool's: that the spec parses and builds for Fedora 41, its
Version equals pyproject.toml's (tools/build-rpm refuses otherwise), the
package is not noarch (it is built for the machine), files under /etc are
%config (rpmlint: non-conffile-in-etc). What this tool adds:

1. The spec parses, with no error or warning from `rpmspec -P`, for Fedora 41
   and for Fedora 42, the release no build here takes: there rpm creates the
   group from the sysusers.d file, so the spec must have no %pre at all, where
   41's runs the groupadd. Fedora's macros come from rpm, or on a host without
   them (Debian) from packaging/rpm/macros.fedora-standin, as `make rpm` does.
2. %post, %preun and %postun run the systemd scriptlets for cni-agent.service,
   and %post makes the bus reload its policy.
3. %files lists every file the DEB installs, derived from packaging/debian
   (cni-agent.install, .dirs, .docs, .examples, the unit, sysusers and
   tmpfiles files dh installs) and pyproject.toml (console scripts, Python packages), or read
   from a built .deb with --deb FILE. Paths map /lib -> /usr/lib (Fedora is
   usr-merged) and /usr/lib/cni -> /usr/libexec/cni (each distribution's
   plugin directory); the Python package must be in %pyproject_save_files,
   documentation must be %doc; the Debian-only
   /usr/share/doc/cni-agent/{copyright,changelog.gz} are not compared.

Exit status 0 when all holds, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "packaging" / "rpm" / "cni-agent.spec"
DEBIAN = ROOT / "packaging" / "debian"
PACKAGE = "cni-agent"
UNIT = "cni-agent.service"
FEDORA_RELEASES = (41, 42)

STANDIN = ROOT / "packaging" / "rpm" / "macros.fedora-standin"

# Debian-only files in the .deb that have no RPM counterpart.
DEBIAN_ONLY = re.compile(r"^/usr/share/doc/cni-agent/(copyright|changelog(\.Debian)?(\.gz)?)$")
# Other documentation: the RPM lists it with %doc NAME (dh_compress may add .gz).
DOC_DIR = "/usr/share/doc/cni-agent/"
DIST_PACKAGES = "/usr/lib/python3/dist-packages/"
DEBIAN_CNI, FEDORA_CNI = "/usr/lib/cni/", "/usr/libexec/cni/"
FILES_DIRECTIVE = re.compile(r"^%(dir|doc|license|ghost|config|attr|verify|defattr)\b(\([^)]*\))?\s*")


def fail_lines(problems: Iterable[str]) -> int:
    problems = list(problems)
    for p in problems:
        print(f"check-rpm-spec: {p}", file=sys.stderr)
    return 1 if problems else 0


def rpm_defines() -> list[str]:
    """Fedora's macros: rpm's own, or the stand-ins `make rpm` uses too."""
    out = subprocess.run(["rpm", "--eval", "%{?_unitdir}"], capture_output=True, text=True,
                         check=True)
    if out.stdout.strip():
        return []
    return ["--load", str(STANDIN), "--define", f"_cni_agent_rpm_dir {STANDIN.parent}"]


def parse_spec(fedora: int) -> tuple[str, list[str]]:
    # After the stand-ins (which say 41): the release asked for wins.
    # Source1 (the sysusers file, read at parse time) is systemd/'s.
    cmd = ["rpmspec", "-P", str(SPEC), *rpm_defines(), "--define", f"fedora {fedora}",
           "--define", f"dist .fc{fedora}", "--define", f"_sourcedir {ROOT / 'systemd'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    problems = [f"fedora {fedora}: rpmspec: {line}" for line in proc.stderr.splitlines()
                if line.strip()]
    if proc.returncode != 0 and not problems:
        problems.append(f"fedora {fedora}: rpmspec -P exited with {proc.returncode}")
    return proc.stdout, problems


def sections(parsed: str) -> dict[str, list[str]]:
    """Lines per section: "preamble", "files", "post", ... (a repeated name concatenates)."""
    out: dict[str, list[str]] = {"preamble": []}
    current = "preamble"
    for line in parsed.splitlines():
        m = re.match(r"^%(package|description|prep|generate_buildrequires|build|install|check|"
                     r"pre|post|preun|postun|pretrans|posttrans|files|changelog)\b(.*)$", line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
            if current == "files":
                out.setdefault("files-header", []).append(m.group(2).strip())
            continue
        out.setdefault(current, []).append(line)
    return out


def files_entries(lines: list[str]) -> dict[str, set[str]]:
    """Path -> the %-directives in front of it (dir, config, doc, ...)."""
    entries: dict[str, set[str]] = {}
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        directives: set[str] = set()
        while m := FILES_DIRECTIVE.match(line):
            directives.add(m.group(1) + (m.group(2) or ""))
            line = line[m.end():]
        for path in line.split():
            entries[path] = directives
    return entries


def pyproject() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        data: dict[str, object] = tomllib.load(f)
    return data


def deb_paths_from_tree() -> tuple[set[str], set[str], set[str]]:
    """(files, directories, Python top-level packages) the DEB installs, from the tree."""
    files: set[str] = set()
    dirs: set[str] = set()
    install = DEBIAN / f"{PACKAGE}.install"
    for line in install.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        *sources, dest = words
        for src in sources:
            files.add("/" + "/".join([dest.strip("/"), Path(src).name]))
    # dh_installdocs: a file by its name, a directory as it is, in the doc dir;
    # dh_installexamples: each match of each line into its examples/.
    for suffix, into in (("docs", ""), ("examples", "examples/")):
        listed = DEBIAN / f"{PACKAGE}.{suffix}"
        if not listed.exists():
            continue
        for line in listed.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            for match in sorted(ROOT.glob(line.strip())):
                found = sorted(f for f in match.rglob("*") if f.is_file()) \
                    if match.is_dir() else [match]
                for f in found:
                    files.add(f"{DOC_DIR}{into}{f.relative_to(match.parent)}")
    dirs_file = DEBIAN / f"{PACKAGE}.dirs"
    if dirs_file.exists():
        for line in dirs_file.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                dirs.add("/" + line.strip().strip("/"))
    # What dh_installsystemd, dh_installsysusers and dh_installtmpfiles install.
    if (DEBIAN / f"{PACKAGE}.service").exists():
        files.add(f"/lib/systemd/system/{PACKAGE}.service")
    if (DEBIAN / f"{PACKAGE}.sysusers").exists():
        files.add(f"/usr/lib/sysusers.d/{PACKAGE}.conf")
    if (DEBIAN / f"{PACKAGE}.tmpfiles").exists():
        files.add(f"/usr/lib/tmpfiles.d/{PACKAGE}.conf")
    project = pyproject()["project"]
    assert isinstance(project, dict)
    for script in project.get("scripts", {}):
        files.add(f"/usr/bin/{script}")
    tool = pyproject().get("tool", {})
    assert isinstance(tool, dict)
    where = tool.get("setuptools", {}).get("packages", {}).get("find", {}).get("where", ["."])
    packages = {p.name for w in where for p in (ROOT / w).iterdir()
                if (p / "__init__.py").is_file()}
    return files, dirs, packages


def deb_paths_from_deb(deb: Path) -> tuple[set[str], set[str], set[str]]:
    """(files, leaf directories, Python top-level packages) in a built .deb."""
    with tempfile.TemporaryDirectory() as tmp:
        tar_path = Path(tmp) / "data.tar"
        with open(tar_path, "wb") as out:
            subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=out, check=True)
        with tarfile.open(tar_path) as tar:
            members = [(m.name.lstrip("."), m) for m in tar.getmembers()]
    files = {name for name, m in members if not m.isdir()}
    all_dirs = {name.rstrip("/") for name, m in members if m.isdir() and name.strip("/")}
    leaves = {d for d in all_dirs
              if not any(n.startswith(d + "/") for n, _ in members if n.rstrip("/") != d)}
    packages: set[str] = set()
    for f in list(files):
        if f.startswith(DIST_PACKAGES):
            top = f[len(DIST_PACKAGES):].split("/", 1)[0]
            if not top.endswith((".dist-info", ".egg-info")):
                packages.add(top.removesuffix(".py"))
            files.discard(f)
    return files, leaves, packages


def rpm_path(deb_path: str) -> str:
    if deb_path.startswith(DEBIAN_CNI):  # each distribution's CNI plugin directory
        return FEDORA_CNI + deb_path[len(DEBIAN_CNI):]
    return "/usr" + deb_path if deb_path.startswith(("/lib/", "/bin/", "/sbin/")) else deb_path


def check_parsed(parsed: str, fedora: int, deb: Path | None) -> list[str]:
    problems: list[str] = []
    where = f"fedora {fedora}"
    secs = sections(parsed)
    pre = "\n".join(secs.get("pre", []))
    if fedora >= 42 and "pre" in secs:
        problems.append(f"{where}: a %pre section (rpm creates the group itself from {fedora} on)")
    if fedora < 42 and "groupadd" not in pre:
        problems.append(f"{where}: %pre does not create the cni-agent group")
    for section, macro in (("post", "systemd_post"), ("preun", "systemd_preun"),
                           ("postun", "systemd_postun_with_restart")):
        body = "\n".join(secs.get(section, []))
        if UNIT not in body:
            problems.append(f"{where}: %{section} does not run %{macro} {UNIT}")
    if "ReloadConfig" not in "\n".join(secs.get("post", [])):
        problems.append(f"{where}: %post does not make the bus reload its policy")

    entries = files_entries(secs.get("files", []))
    header = " ".join(secs.get("files-header", []))
    uses_pyproject_files = "-f" in header.split() and "pyproject-files" in header
    # As the spec writes it: the parsed %install holds the macro's expansion.
    saved = {w for m in re.finditer(r"^%pyproject_save_files\s+(.*)$", SPEC.read_text(), re.M)
             for w in m.group(1).split() if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", w)}
    files, dirs, packages = deb_paths_from_deb(deb) if deb else deb_paths_from_tree()
    for path in sorted(files):
        if DEBIAN_ONLY.match(path):
            continue
        if path.startswith(DOC_DIR):
            doc = path[len(DOC_DIR):].removesuffix(".gz")
            # %doc docs/x.md installs x.md in the doc dir, %doc docs the
            # directory docs/ with everything in it, as dh_installdocs does.
            docs = [Path(p) for p, directives in entries.items() if "doc" in directives]
            if not any(doc == d.name or (doc.startswith(f"{d.name}/") and (ROOT / d).is_dir())
                       for d in docs):
                problems.append(f"{where}: %files lacks %doc {doc} (the DEB installs {path})")
            continue
        target = rpm_path(path)
        if target not in entries:
            problems.append(f"{where}: %files lacks {target} (the DEB installs {path})")
    for path in sorted(dirs):
        target = rpm_path(path)
        if target not in entries:
            problems.append(f"{where}: %files lacks %dir {target} (the DEB ships the directory)")
    for pkg in sorted(packages):
        if not uses_pyproject_files or pkg not in saved:
            problems.append(f"{where}: the Python package {pkg} (in the DEB) is not in "
                            "%pyproject_save_files with %files -f %{pyproject_files}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--deb", type=Path,
                        help="compare %%files with this built .deb instead of packaging/debian")
    parser.add_argument("--show", action="store_true", help="print the parsed spec")
    args = parser.parse_args()
    for tool in ("rpm", "rpmspec") + (("dpkg-deb",) if args.deb else ()):
        if not shutil.which(tool):
            return fail_lines([f"{tool} not found (Debian: apt-get install rpm; "
                               "tools/setup-system installs it)"])
    problems: list[str] = []
    for fedora in FEDORA_RELEASES:
        parsed, errors = parse_spec(fedora)
        problems += errors
        if args.show:
            print(f"### fedora {fedora}\n{parsed}")
        if parsed:
            problems += check_parsed(parsed, fedora, args.deb)
    if problems:
        return fail_lines(problems)
    against = str(args.deb) if args.deb else "packaging/debian"
    print(f"check-rpm-spec: {SPEC.relative_to(ROOT)} OK for Fedora "
          f"{', '.join(map(str, FEDORA_RELEASES))}; %files covers {against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
