"""A member may not pick its address through CNI_ARGS when `ips` is closed to it.

Issue 35 closed the capabilities that reach other sandboxes' addresses
(`ips`, `mac`, ...) to callers that are not root unless the admin lists them
in `access.capabilities`. host-local (1.1.1) takes a requested address from
CNI_ARGS too (`IP=`, with `IgnoreUnknown=1` so bridge lets it pass): the
same lever as the `ips` capability, under another name. Root may (see
tests/daemon/test_sandboxes.py::test_args_a_plugin_rejects_fail_setup_cleanly).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.test_owners import ERR, cli, own_netns
from tests.support.agent import Agent, Bus
from tests.support.net import allocations
from tests.support.plugins import Control

pytestmark = pytest.mark.root


def test_a_member_cannot_choose_its_address_through_args_when_ips_is_closed(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    tmp_path: Path,
) -> None:
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        # The capability: refused (test_hostile_callers covers it; here as the reference).
        out = cli(agent, member, "setup", "vm1", path, "--capabilities",
                  json.dumps({"ips": ["10.215.0.77/24"]}))
        assert out.returncode == 4, out
        # The same address through CNI_ARGS: refused as well, and not allocated.
        out = cli(agent, member, "setup", "vm1", path, "--arg", "IgnoreUnknown=1",
                  "--arg", "IP=10.215.0.77")
        assert "10.215.0.77" not in allocations(tmp_path / "ipam", "pods"), \
            (out.stdout, allocations(tmp_path / "ipam", "pods"))
        assert out.returncode == 4 and "argument IP sets what capability 'ips' sets" in out.stderr, out
    finally:
        cli(agent, member, "teardown", "vm1", path)
        mine.kill()


def test_a_member_passes_no_kubernetes_identity_nor_an_unlisted_key(
    make_agent: Callable[..., Agent], permissive_bus: Bus, bridge_chain: str, member: str,
    control: Control, netns: str, tmp_path: Path,
) -> None:
    """Issue 44, item 4: a recording plugin saw a member's `K8S_POD_NAMESPACE=kube-system;
    K8S_POD_NAME=coredns-…`; Calico, Cilium and Multus key policy and IPAM on them."""
    agent = make_agent(bus=permissive_bus, access={"groups": [member], "networks": ["pods"]})
    mine = own_netns(member)
    try:
        path = f"/proc/{mine.pid}/ns/net"
        for given, key in ((["--pod", "kube-system/coredns-5d78c9869d-x2x8w/7c1e"],
                            "option pod passes argument K8S_POD_NAMESPACE"),
                           (["--arg", "IgnoreUnknown=1", "--arg", "K8S_POD_NAME=coredns"],
                            "argument K8S_POD_NAME"),
                           (["--arg", "IgnoreUnknown=1", "--arg", "FOO=1"], "argument FOO")):
            out = cli(agent, member, "setup", "vm1", path, *given)
            assert out.returncode == 4, (given, out)
            assert f"access denied: {key}" in out.stderr, out
            assert "is not allowed to callers that are not root (access.cni_args: none)" in \
                out.stderr, out
        # Attach is the same decision (refused before its namespace is even looked at).
        out = agent.gdbus("Attach", "vm1", path, "pods", "eth1",
                          "{'args': <{'K8S_POD_INFRA_CONTAINER_ID': 'abc'}>}", member=member)
        assert ERR + "AccessDenied" in out.stderr and "K8S_POD_INFRA_CONTAINER_ID" in out.stderr, \
            out.stderr
        assert "ADD" not in control.commands()  # no plugin saw any of it
        assert allocations(tmp_path / "ipam", "pods") == []
        # IgnoreUnknown always passes, and what the admin lists.
        agent.config["access"]["cni_args"] = ["FOO", "K8S_POD_NAMESPACE", "K8S_POD_NAME",
                                              "K8S_POD_INFRA_CONTAINER_ID"]
        agent.write_config()
        agent.call("Reload")
        out = cli(agent, member, "setup", "vm1", path, "--arg", "IgnoreUnknown=1",
                  "--arg", "FOO=1", "--pod", "team-a/builder")
        assert out.returncode == 0, out
        [add] = [r for r in control.records() if r["command"] == "ADD"]
        assert add["env"]["CNI_ARGS"] == (
            "K8S_POD_NAMESPACE=team-a;K8S_POD_NAME=builder;K8S_POD_INFRA_CONTAINER_ID="
            f"{add['env']['CNI_CONTAINERID']};IgnoreUnknown=1;FOO=1"), add["env"]
        # A pod uid adds K8S_POD_UID, which is not listed.
        out = cli(agent, member, "setup", "vm2", path, "--network", "pods:eth1",
                  "--pod", "team-a/builder/u-1")
        assert out.returncode == 4 and "option pod passes argument K8S_POD_UID" in out.stderr, out
        assert cli(agent, member, "teardown", "vm1", path).returncode == 0
    finally:
        mine.kill()
    # Root: unchanged, every key and the pod option pass.
    agent.setup("rootpod", netns, args={"IgnoreUnknown": "1", "BAR": "2"},
                pod={"namespace": "kube-system", "name": "coredns", "uid": "u-9"})
    add = [r for r in control.records() if r["command"] == "ADD"][-1]
    assert add["env"]["CNI_ARGS"] == ("K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=coredns;"
                                      "K8S_POD_INFRA_CONTAINER_ID=rootpod;K8S_POD_UID=u-9;"
                                      "IgnoreUnknown=1;BAR=2")
    agent.call("Teardown", "ssa{sv}", "rootpod", netns, "0")
