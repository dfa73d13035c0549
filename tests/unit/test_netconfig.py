"""Network configuration parsing and directory loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cni_agent.cni.config import load_dir, parse_list, parse_single
from cni_agent.cni.errors import ConfigError

TESTDATA = Path(__file__).resolve().parents[1] / "data" / "net.d"


def _write(d: Path, name: str, obj: object) -> None:
    d.mkdir(exist_ok=True)
    (d / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_users_configs_parse_as_they_are(tmp_path: Path) -> None:
    shutil.copytree(TESTDATA, tmp_path / "net.d")
    loaded = load_dir(str(tmp_path / "net.d"))
    assert loaded.invalid == ()
    assert [n.name for n in loaded.networks] == ["bridge-firewalld", "bridge-firewall"]
    crio = loaded.networks[0]
    assert crio.cni_version == "0.4.0"
    assert crio.plugin_types == ("bridge", "portmap", "firewall")
    assert crio.plugins[1].capabilities == frozenset({"portMappings"})
    assert crio.bytes == (TESTDATA / "100-crio-bridge.conflist").read_bytes()


def test_load_order_is_byte_order_and_first_file_wins(tmp_path: Path) -> None:
    d = tmp_path / "d"
    _write(d, "5-b.conf", {"cniVersion": "1.0.0", "name": "b", "type": "x"})
    _write(d, "10-a.conflist", {"cniVersion": "1.0.0", "name": "a", "plugins": [{"type": "x"}]})
    _write(d, "20-dup.json", {"cniVersion": "1.0.0", "name": "a", "type": "y"})
    _write(d, "README.md", "not a config")
    loaded = load_dir(str(d))
    assert [n.name for n in loaded.networks] == ["a", "b"]
    assert len(loaded.invalid) == 1
    assert loaded.invalid[0].source.endswith("20-dup.json")
    assert "already defined by" in loaded.invalid[0].reason


def test_missing_directory_means_no_networks(tmp_path: Path) -> None:
    loaded = load_dir(str(tmp_path / "nope"))
    assert loaded.networks == () and loaded.invalid == ()


def test_single_plugin_becomes_a_list() -> None:
    net = parse_single(json.dumps(
        {"cniVersion": "0.4.0", "name": "n", "type": "bridge", "disableCheck": "true"}
    ).encode())
    assert net.plugin_types == ("bridge",)
    assert net.disable_check is True
    assert json.loads(net.bytes)["plugins"][0]["type"] == "bridge"


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "not a JSON object"),
        ({"cniVersion": "1.0.0", "plugins": [{"type": "x"}]}, '"name" is missing'),
        ({"cniVersion": "1.0.0", "name": "bad name", "plugins": [{"type": "x"}]}, "invalid network name"),
        ({"cniVersion": "1.0.0", "name": "n", "plugins": []}, "non-empty list"),
        ({"cniVersion": "1.0.0", "name": "n", "plugins": [{}]}, 'has no "type"'),
        ({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "../x"}]}, "invalid type"),
        ({"cniVersion": "9.9.9", "name": "n", "plugins": [{"type": "x"}]}, "not supported"),
        ({"name": "n", "plugins": [{"type": "x"}]}, '"cniVersion" is missing'),
        ({"cniVersion": "1.0.0", "name": "n", "disableGC": "maybe", "plugins": [{"type": "x"}]},
         "true or false"),
    ],
)
def test_invalid_lists_say_why(doc: object, reason: str) -> None:
    data = (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    with pytest.raises(ConfigError) as e:
        parse_list(data, "/etc/cni/net.d/x.conflist")
    assert reason in e.value.reason
    assert e.value.source == "/etc/cni/net.d/x.conflist"


def test_cni_versions_picks_highest_supported() -> None:
    net = parse_list(json.dumps({
        "cniVersion": "0.4.0", "cniVersions": ["0.4.0", "1.0.0", "1.1.0", "1.2.0", "2.0.0"],
        "name": "n", "plugins": [{"type": "x"}],
    }).encode())
    assert net.cni_version == "1.1.0"


def test_invalid_files_are_kept_with_reasons_not_raised(tmp_path: Path) -> None:
    d = tmp_path / "d"
    _write(d, "00-broken.conflist", "{")
    _write(d, "10-ok.conflist", {"cniVersion": "1.0.0", "name": "ok", "plugins": [{"type": "x"}]})
    loaded = load_dir(str(d))
    assert [n.name for n in loaded.networks] == ["ok"]
    assert loaded.invalid[0].source.endswith("00-broken.conflist")
    assert "not valid JSON" in loaded.invalid[0].reason


@pytest.mark.parametrize(
    ("version", "versions", "picked"),
    [
        ("1.0.0", ["0.3.1", "0.4.0"], "1.0.0"),  # cniVersion is a candidate too (libcni)
        ("0.4.0", ["1.0.0"], "1.0.0"),
        ("9.9.9", ["0.4.0"], "0.4.0"),  # above what we implement: ignored, as libcni
        (None, ["0.4.0", "1.0.0"], "1.0.0"),
    ],
)
def test_cni_versions_and_cni_version_are_picked_from_together(
    version: str | None, versions: list[str], picked: str
) -> None:
    doc: dict[str, object] = {"cniVersions": versions, "name": "n", "plugins": [{"type": "x"}]}
    if version is not None:
        doc["cniVersion"] = version
    assert parse_list(json.dumps(doc).encode()).cni_version == picked
