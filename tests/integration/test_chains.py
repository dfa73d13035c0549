"""ADD/DEL/CHECK/STATUS/GC/VERSION chains, recorded by our scripted plugin."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from cni_agent.cni.config import NetworkConfigList, parse_list
from cni_agent.cni.errors import ConfigError, NoCachedResult, PluginError
from cni_agent.cni.runtime import CNIRuntime, RuntimeConf, Timeouts
from tests.support.plugins import Control, install_plugin

TYPES = ("testplug", "testplug2", "testplug3")


@pytest.fixture
def runtime(tmp_path: Path, plugin_dir: Path) -> CNIRuntime:
    for t in TYPES[1:]:
        install_plugin(plugin_dir, t)
    return CNIRuntime([str(plugin_dir)], str(tmp_path / "state"), timeouts=Timeouts(status=5))


def make_net(control: Control, version: str = "1.1.0", **extra: Any) -> NetworkConfigList:
    plugins = [
        {"type": "testplug", "control": str(control.path), "capabilities": {"portMappings": True}},
        {"type": "testplug2", "control": str(control.path),
         "capabilities": {"bandwidth": True, "mac": False}},
        {"type": "testplug3", "control": str(control.path), "extra": {"kept": [1, 2]}},
    ]
    doc = {"cniVersion": version, "name": "chain", "plugins": plugins, **extra}
    return parse_list(json.dumps(doc).encode(), "/etc/cni/net.d/10-chain.conflist")


RT = RuntimeConf("sbx1", "/run/netns/none", "eth0", (("K", "V"),),
                 {"portMappings": [{"hostPort": 80, "containerPort": 8080, "protocol": "tcp"}],
                  "mac": "02:00:00:00:00:09"})


def _by(records: list[dict[str, Any]], command: str) -> list[dict[str, Any]]:
    return [r for r in records if r["command"] == command]


async def test_add_threads_prev_result_and_filters_capabilities(
    runtime: CNIRuntime, control: Control
) -> None:
    net = make_net(control)
    result = await runtime.add(net, RT)
    adds = _by(control.records(), "ADD")
    assert [r["type"] for r in adds] == list(TYPES)
    first, second, third = (r["stdin"] for r in adds)
    assert first["name"] == "chain" and first["cniVersion"] == "1.1.0"
    assert "prevResult" not in first
    assert first["runtimeConfig"] == {"portMappings": RT.capability_args["portMappings"]}
    # "mac" was supplied but not declared true by any plugin: nobody gets it.
    assert "runtimeConfig" not in second and "runtimeConfig" not in third
    assert second["prevResult"]["ips"] == first_result_ips(result)
    assert third["extra"] == {"kept": [1, 2]}
    assert adds[0]["env"]["CNI_ARGS"] == "K=V"
    assert result["cniVersion"] == "1.1.0"


def first_result_ips(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["ips"])


async def test_add_writes_a_libcni_cache_entry(runtime: CNIRuntime, control: Control, tmp_path: Path) -> None:
    net = make_net(control)
    result = await runtime.add(net, RT)
    path = tmp_path / "state" / "results" / "chain-sbx1-eth0"
    doc = json.loads(path.read_text())
    assert set(doc) == {"kind", "containerId", "config", "ifName", "networkName", "netns",
                        "cniArgs", "capabilityArgs", "result"}
    assert doc["kind"] == "cniCacheV1"
    assert base64.b64decode(doc["config"]) == net.bytes
    assert doc["cniArgs"] == [["K", "V"]]
    assert doc["capabilityArgs"] == dict(RT.capability_args)
    assert doc["result"] == result
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [a.ifname for a in runtime.cache.for_container("sbx1")] == ["eth0"]
    assert runtime.cache.for_container("sbx") == []


async def test_add_stops_at_first_error_and_caches_nothing(runtime: CNIRuntime, control: Control) -> None:
    control.set("ADD", "fail", code=7, msg="bad config", only=["testplug2"])
    net = make_net(control)
    with pytest.raises(PluginError) as e:
        await runtime.add(net, RT)
    assert e.value.plugin == "testplug2" and e.value.code == 7
    assert [r["type"] for r in _by(control.records(), "ADD")] == ["testplug", "testplug2"]
    assert runtime.cache.for_container("sbx1") == []


async def test_del_runs_in_reverse_with_cached_prev_result(runtime: CNIRuntime, control: Control) -> None:
    net = make_net(control, "0.4.0")
    result = await runtime.add(net, RT)
    control.reset_records()
    await runtime.delete(net, RuntimeConf("sbx1", "", "eth0", RT.args, RT.capability_args))
    dels = _by(control.records(), "DEL")
    assert [r["type"] for r in dels] == list(reversed(TYPES))
    assert all(r["stdin"]["prevResult"] == result for r in dels)
    assert dels[0]["env"]["CNI_NETNS"] == ""
    assert runtime.cache.for_container("sbx1") == []


async def test_del_without_prev_result_below_0_4_0(runtime: CNIRuntime, control: Control) -> None:
    net = make_net(control, "0.3.1")
    await runtime.add(net, RT)
    control.reset_records()
    await runtime.delete(net, RT)
    assert all("prevResult" not in r["stdin"] for r in _by(control.records(), "DEL"))


async def test_failed_del_keeps_the_cache_entry_and_repeat_del_succeeds(
    runtime: CNIRuntime, control: Control
) -> None:
    net = make_net(control)
    await runtime.add(net, RT)
    control.set("DEL", "fail", code=5, msg="disk on fire")
    with pytest.raises(PluginError):
        await runtime.delete(net, RT)
    assert len(runtime.cache.for_container("sbx1")) == 1
    control.clear("DEL")
    await runtime.delete(net, RT)
    await runtime.delete(net, RT)  # repeated DEL succeeds
    assert runtime.cache.for_container("sbx1") == []


async def test_unreadable_cache_entry_does_not_block_del(
    runtime: CNIRuntime, control: Control, tmp_path: Path
) -> None:
    net = make_net(control)
    await runtime.add(net, RT)
    (tmp_path / "state" / "results" / "chain-sbx1-eth0").write_text("{garbage")
    control.reset_records()
    await runtime.delete(net, RT)
    assert all("prevResult" not in r["stdin"] for r in _by(control.records(), "DEL"))
    assert not (tmp_path / "state" / "results" / "chain-sbx1-eth0").exists()


async def test_check_uses_cached_result_and_version_gates(runtime: CNIRuntime, control: Control) -> None:
    net = make_net(control, "0.4.0")
    result = await runtime.add(net, RT)
    control.reset_records()
    assert await runtime.check(net, RT) is True
    checks = _by(control.records(), "CHECK")
    assert [r["type"] for r in checks] == list(TYPES)
    assert all(r["stdin"]["prevResult"] == result for r in checks)
    assert checks[0]["stdin"]["runtimeConfig"] == {"portMappings": RT.capability_args["portMappings"]}

    old = make_net(control, "0.3.1")
    control.reset_records()
    assert await runtime.check(old, RT) is False
    assert control.records() == []
    assert await runtime.check(make_net(control, "1.0.0", disableCheck=True), RT) is False
    assert control.records() == []


async def test_check_without_cached_result_is_an_error(runtime: CNIRuntime, control: Control) -> None:
    with pytest.raises(NoCachedResult) as e:
        await runtime.check(make_net(control, "1.0.0"), RT)
    assert "no cached result" in str(e.value)


async def test_status_codes_50_and_51_come_back_unchanged(runtime: CNIRuntime, control: Control) -> None:
    net = make_net(control)
    assert await runtime.status(net) is True
    records = _by(control.records(), "STATUS")
    assert [r["type"] for r in records] == list(TYPES)
    assert "runtimeConfig" not in records[0]["stdin"]
    assert records[0]["env"]["CNI_CONTAINERID"] == ""
    for code in (50, 51):
        control.set("STATUS", "fail", code=code, msg="daemon down")
        with pytest.raises(PluginError) as e:
            await runtime.status(net)
        assert e.value.code == code and e.value.verb == "STATUS"


async def test_status_is_not_executed_before_1_1_0(runtime: CNIRuntime, control: Control) -> None:
    assert await runtime.status(make_net(control, "1.0.0")) is False
    assert control.records() == []


async def test_gc_sends_the_valid_list_to_every_plugin_past_errors(
    runtime: CNIRuntime, control: Control,
) -> None:
    net = make_net(control)
    control.set("GC", "fail", code=999, msg="first plugin GC broke", only=["testplug"])
    errors = await runtime.gc(net, [("live", "eth0"), ("live", "eth0")])
    # Only the verb: stale DELs are the reaper's, each under its sandbox's lock.
    assert _by(control.records(), "DEL") == []
    gcs = _by(control.records(), "GC")
    assert [r["type"] for r in gcs] == list(TYPES)  # continued past errors
    expected = [{"containerID": "live", "ifname": "eth0"}]
    assert gcs[0]["stdin"]["cni.dev/valid-attachments"] == expected
    assert gcs[0]["stdin"]["cni.dev/attachments"] == expected
    assert len(errors) == 1 and "first plugin GC broke" in errors[0]


async def test_gc_disabled_or_old_version_sends_no_gc_verb(runtime: CNIRuntime, control: Control) -> None:
    await runtime.gc(make_net(control, "1.1.0", disableGC=True), [])
    await runtime.gc(make_net(control, "1.0.0"), [])
    assert _by(control.records(), "GC") == []


async def test_validate_checks_presence_and_versions(
    runtime: CNIRuntime, control: Control, plugin_dir: Path
) -> None:
    (plugin_dir / "testplug.control").symlink_to(control.path)
    await runtime.validate(make_net(control))
    control.update(versions=["0.4.0", "1.0.0"])
    os.utime(plugin_dir / "testplug", ns=(2, 2))  # a new binary: asked again
    with pytest.raises(ConfigError) as e:
        await runtime.validate(make_net(control, "1.1.0"))
    assert "does not support cniVersion 1.1.0" in str(e.value)
    doc = {"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "missing-plugin"}]}
    with pytest.raises(ConfigError) as e:
        await runtime.validate(parse_list(json.dumps(doc).encode(), "f.conflist"))
    assert "no binary 'missing-plugin'" in str(e.value)


async def test_version_answers_are_cached_until_the_binary_changes(
    runtime: CNIRuntime, control: Control, plugin_dir: Path
) -> None:
    # VERSION stdin carries no config, so the plugin reads its sidecar control.
    (plugin_dir / "testplug.control").symlink_to(control.path)
    net = make_net(control)
    await runtime.validate(net)
    await runtime.validate(net)
    assert len([r for r in _by(control.records(), "VERSION") if r["type"] == "testplug"]) == 1
    os.utime(plugin_dir / "testplug", ns=(1, 1))
    await runtime.validate(net)
    assert len([r for r in _by(control.records(), "VERSION") if r["type"] == "testplug"]) == 2
