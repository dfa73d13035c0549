"""The one stdin builder: what a plugin reads (libcni's buildOneConfig)."""

from __future__ import annotations

import json
from typing import Any

from cni_agent.cni.config import parse_list
from cni_agent.cni.runtime import plugin_stdin


def _stdin(plugin: dict[str, Any], caps: dict[str, Any] | None = None,
           prev: dict[str, Any] | None = None) -> dict[str, Any]:
    net = parse_list(json.dumps({"cniVersion": "1.0.0", "name": "n", "plugins": [plugin]}).encode())
    return json.loads(plugin_stdin(net, net.plugins[0], prev, caps))  # type: ignore[no-any-return]


def test_static_runtime_config_is_kept_and_capability_args_merged_over_it() -> None:
    plugin = {"type": "portmap", "capabilities": {"portMappings": True, "bandwidth": True},
              "runtimeConfig": {"portMappings": [{"hostPort": 1}], "static": "kept"}}
    caps = {"portMappings": [{"hostPort": 8080}], "mac": "02:00:00:00:00:09"}
    got = _stdin(plugin, caps)
    # The caller's value wins a same-named key; undeclared capabilities are not injected.
    assert got["runtimeConfig"] == {"portMappings": [{"hostPort": 8080}], "static": "kept"}


def test_static_runtime_config_alone_passes_through() -> None:
    plugin = {"type": "x", "runtimeConfig": {"static": 1}}
    assert _stdin(plugin)["runtimeConfig"] == {"static": 1}
    assert _stdin(plugin, {"mac": "m"})["runtimeConfig"] == {"static": 1}  # mac not declared


def test_no_runtime_config_when_nothing_to_say() -> None:
    got = _stdin({"type": "x", "capabilities": {"mac": True}}, {"ips": ["10.0.0.2/24"]})
    assert "runtimeConfig" not in got
    assert got["name"] == "n" and got["cniVersion"] == "1.0.0"


def test_prev_result_replaces_a_static_one() -> None:
    got = _stdin({"type": "x", "prevResult": {"stale": True}}, prev={"cniVersion": "1.0.0"})
    assert got["prevResult"] == {"cniVersion": "1.0.0"}
    assert "prevResult" not in _stdin({"type": "x", "prevResult": {"stale": True}})
