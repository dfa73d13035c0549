"""Which plugin dirs and binaries a root agent trusts (cni/trust.py, exec.find_plugin)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cni_agent.cni.errors import PluginUnsafe
from cni_agent.cni.exec import find_plugin
from cni_agent.cni.runtime import CNIRuntime
from cni_agent.cni.trust import check_plugin_dirs, untrusted_reason
from tests.support.plugins import install_plugin

pytestmark = pytest.mark.root

NOBODY = 65534


def _dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path


def test_a_root_owned_dir_under_sticky_tmp_is_trusted(tmp_path: Path) -> None:
    d = _dir(tmp_path / "bin")
    assert os.stat("/tmp").st_mode & 0o1777 == 0o1777  # world-writable, sticky
    assert untrusted_reason(str(d)) is None


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_dir_writable_by_others_is_refused_even_sticky(tmp_path: Path, mode: int) -> None:
    d = _dir(tmp_path / "bin", mode)
    assert untrusted_reason(str(d)) == f"{d} is writable by non-root users (mode {_mode(d)})"


def test_a_dir_whose_parent_is_world_writable_is_refused(tmp_path: Path) -> None:
    parent = _dir(tmp_path / "ww", 0o777)
    d = _dir(parent / "bin")
    assert untrusted_reason(str(d)) == f"{parent} is writable by non-root users (mode drwxrwxrwx)"
    os.chmod(parent, 0o1777)  # sticky: nobody else can replace our root-owned bin
    assert untrusted_reason(str(d)) is None


def test_a_dir_or_an_ancestor_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    parent = _dir(tmp_path / "p")
    d = _dir(parent / "bin")
    os.chown(parent, NOBODY, NOBODY)
    assert untrusted_reason(str(d)) == f"{parent} is owned by uid {NOBODY}, not root"
    os.chown(parent, 0, 0)
    os.chown(d, NOBODY, 0)
    assert untrusted_reason(str(d)) == f"{d} is owned by uid {NOBODY}, not root"


def test_symlinks_are_followed_through_every_directory_they_pass(tmp_path: Path) -> None:
    real = _dir(tmp_path / "real")
    user_dir = _dir(tmp_path / "user")
    os.chown(user_dir, NOBODY, NOBODY)
    (user_dir / "hop").symlink_to(real)  # the user could re-point this one
    (tmp_path / "bin").symlink_to(user_dir / "hop")
    assert untrusted_reason(str(tmp_path / "bin")) == f"{user_dir} is owned by uid {NOBODY}, not root"
    # A link of another user's in a sticky dir can be re-pointed by that user.
    sticky = _dir(tmp_path / "sticky", 0o1777)
    (sticky / "link").symlink_to(real)
    os.chown(sticky / "link", NOBODY, NOBODY, follow_symlinks=False)
    assert untrusted_reason(str(sticky / "link")) == (
        f"{sticky / 'link'} (a symlink) is owned by uid {NOBODY}, not root")
    (tmp_path / "ok").symlink_to(real)
    assert untrusted_reason(str(tmp_path / "ok")) is None


def test_a_group_writable_binary_is_refused_by_name(tmp_path: Path) -> None:
    d = tmp_path / "bin"
    binary = install_plugin(d, "testplug")
    os.chmod(binary, 0o775)
    with pytest.raises(PluginUnsafe) as e:
        find_plugin("testplug", [str(d)], "ADD")
    assert str(e.value) == (f"plugin testplug ADD: refusing to run {binary}: {binary} is "
                            "writable by non-root users (mode -rwxrwxr-x)")


def test_plugin_dirs_are_sorted_into_trusted_untrusted_and_missing(tmp_path: Path) -> None:
    good = _dir(tmp_path / "good")
    bad = _dir(tmp_path / "bad", 0o777)
    gone = tmp_path / "gone"
    path = check_plugin_dirs([str(bad), str(gone), str(good), str(good)])
    assert path.trusted == (str(good),)
    assert path.untrusted == ((str(bad), f"{bad} is writable by non-root users (mode drwxrwxrwx)"),)
    assert path.missing == (str(gone),)
    assert path.cni_path == str(good)


def test_runtime_skips_an_untrusted_dir_listed_first(tmp_path: Path) -> None:
    planted = install_plugin(tmp_path / "ww", "host-local")
    os.chmod(planted.parent, 0o777)
    real = install_plugin(tmp_path / "bin", "host-local")
    runtime = CNIRuntime([str(planted.parent), str(real.parent)], str(tmp_path / "state"))
    assert runtime.cni_path == str(real.parent)
    assert runtime.find("host-local", "ADD") == str(real)
    # Only in the refused dir: refused by name, not "not found".
    real.unlink()
    with pytest.raises(PluginUnsafe) as e:
        runtime.find("host-local", "ADD")
    assert f"refusing to run {planted}: {planted.parent} is writable by non-root users" in str(e.value)
    # Recomputed on refresh: fixed, it is used again.
    os.chmod(planted.parent, 0o755)
    runtime.refresh_plugin_path()
    assert runtime.cni_path == f"{planted.parent}:{real.parent}"
    assert runtime.find("host-local") == str(planted)


def test_an_agent_that_is_not_root_trusts_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _dir(tmp_path / "ww", 0o777)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert untrusted_reason(str(d)) is None
    assert check_plugin_dirs([str(d)]).trusted == (str(d),)


def _mode(path: Path) -> str:
    return stat.filemode(os.stat(path).st_mode)


def test_a_dir_holding_a_file_others_can_replace_is_left_out(tmp_path: Path) -> None:
    # A plugin may exec any file of a CNI_PATH dir (bridge its IPAM plugin).
    d = tmp_path / "bin"
    install_plugin(d, "bridge")
    ipam = install_plugin(d, "host-local")
    os.chmod(ipam, 0o775)
    assert check_plugin_dirs([str(d)]).untrusted == (
        (str(d), f"{ipam} is writable by non-root users (mode -rwxrwxr-x)"),)
    os.chmod(ipam, 0o755)
    os.chown(ipam, NOBODY, NOBODY)
    assert check_plugin_dirs([str(d)]).untrusted == (
        (str(d), f"{ipam} is owned by uid {NOBODY}, not root"),)
    ipam.unlink()
    elsewhere = _dir(tmp_path / "ww", 0o777)
    (d / "host-local").symlink_to(elsewhere / "host-local")
    (d / "dangling").symlink_to(tmp_path / "nothing")
    assert check_plugin_dirs([str(d)]).trusted == (str(d),)  # both dangle: nothing to run
    install_plugin(tmp_path / "stage", "host-local").rename(elsewhere / "host-local")
    assert check_plugin_dirs([str(d)]).untrusted == (
        (str(d), f"{elsewhere} is writable by non-root users (mode drwxrwxrwx)"),)
