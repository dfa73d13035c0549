"""docs/upgrade.md and docs/removal.md name the systemd guest's checks that
run each step (`make test-systemd`, `make test-rpm`): every check they name
exists, every step of theirs has one, and their package files are this
release's and the previous one's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = ("upgrade.md", "removal.md")
GUESTS = ("guest-check", "guest-rpm-check")
# Backticked words shaped like a check's name that are not one.
NOT_CHECKS = {"cni-agent", "cni-agent-shim"}


def guest_checks(guest: str) -> set[str]:
    text = (REPO / "tests" / "systemd" / guest).read_text()
    return set(re.findall(r"^\s*check ([a-z0-9-]+) \w+$", text, re.M))


def cited(page: str) -> set[str]:
    text = (REPO / "docs" / page).read_text()
    return set(re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", text)) - NOT_CHECKS


def version() -> str:
    m = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert m is not None
    return m.group(1)


def previous_release() -> str:
    m = re.search(r'^PREVIOUS_RELEASE = "(.+)"$', (REPO / "tools" / "test-systemd").read_text(),
                  re.M)
    assert m is not None
    return m.group(1)


@pytest.mark.parametrize("page", PAGES)
def test_every_check_a_page_names_exists(page: str) -> None:
    known = guest_checks("guest-check") | guest_checks("guest-rpm-check")
    names = cited(page)
    assert names, f"docs/{page} names no check of the systemd guest"
    assert not names - known, f"docs/{page} names checks that do not exist: {names - known}"


def test_the_pages_name_the_guests_upgrade_and_removal_checks() -> None:
    named = cited("upgrade.md") | cited("removal.md")
    for guest in GUESTS:
        steps = {c for c in guest_checks(guest)
                 if re.search(r"upgrade|downgrade|release|remove|purge|hand-back", c)}
        steps -= {"upgrade-with-live-sandbox", "remove"}  # the RPM's: docs/fedora.md has them
        assert not steps - named, f"{guest}'s checks no page names: {steps - named}"


def test_the_upgrade_page_names_this_release_and_the_previous_one() -> None:
    text = (REPO / "docs" / "upgrade.md").read_text()
    for v in (version(), previous_release()):
        assert f"cni-agent_{v}_amd64.deb" in text and f"cni-agent-{v}-1.x86_64.rpm" in text, v
    news = (REPO / "NEWS.md").read_text()
    assert f"\n## {version()} " in news and f"### Upgrading from {previous_release()}" in news
