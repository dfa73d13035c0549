"""The shim's protocol, decided in the agent: requests checked as a plugin
checks them, agent errors mapped to the spec's codes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cni_agent.api import AgentError, ErrorKind
from cni_agent.cli.shim_config import conflist
from cni_agent.cni.config import SHIM_VERSIONS
from cni_agent.cni.errors import InvalidArgument, PluginError
from cni_agent.service.cnicall import Refusal, ShimCall, failure_answer, parse_call, parse_cni_args

REPO = Path(__file__).resolve().parents[2]
ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/run/netns/x",
       "CNI_IFNAME": "eth0"}
CONF = json.dumps({"cniVersion": "1.0.0", "name": "pods", "type": "cni-agent-shim",
                   "network": "podnet", "runtimeConfig": {"portMappings": []}})


def refusal(env: dict[str, str], conf: str = CONF) -> Refusal:
    with pytest.raises(Refusal) as info:
        parse_call(env, conf)
    return info.value


def test_an_add_is_parsed_with_its_args_and_capabilities() -> None:
    call = parse_call({**ENV, "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAME=web"}, CONF)
    assert (call.command, call.cni_version, call.origin, call.network) == \
        ("ADD", "1.0.0", "pods", "podnet")
    assert call.args == (("IgnoreUnknown", "1"), ("K8S_POD_NAME", "web"))
    assert call.capabilities == {"portMappings": []}


@pytest.mark.parametrize(("env", "conf", "code", "text"), [
    ({**ENV, "CNI_COMMAND": ""}, CONF, 4, "CNI_COMMAND is not set"),
    ({**ENV, "CNI_COMMAND": "UP"}, CONF, 4, "not one of"),
    ({**ENV, "CNI_CONTAINERID": ""}, CONF, 4, "CNI_CONTAINERID is not set"),
    ({**ENV, "CNI_NETNS": ""}, CONF, 4, "CNI_NETNS is not set"),
    ({**ENV, "CNI_IFNAME": "x" * 5000}, CONF, 4, "longer than"),
    ({**ENV, "CNI_ARGS": "a=1;novalue"}, CONF, 4, "CNI_ARGS"),
    (ENV, "{", 6, "not valid JSON"),
    (ENV, "[]", 6, "not a JSON object"),
    (ENV, json.dumps({"cniVersion": "0.2.0", "name": "x"}), 1, "not supported"),
    (ENV, json.dumps({"cniVersion": "1.0.0"}), 7, 'no "name"'),
    (ENV, json.dumps({"cniVersion": "1.0.0", "name": "x", "network": 3}), 7, "string"),
    (ENV, json.dumps({"cniVersion": "1.0.0", "name": "x", "prevResult": {}}), 7, "first plugin"),
    ({"CNI_COMMAND": "GC"}, json.dumps({"cniVersion": "1.1.0", "name": "x",
                                        "cni.dev/valid-attachments": [{"containerID": 1}]}),
     7, "valid-attachments"),
])
def test_bad_requests_get_the_specs_codes(env: dict[str, str], conf: str, code: int,
                                          text: str) -> None:
    r = refusal(env, conf)
    assert r.code == code and text in r.msg


def test_a_del_needs_no_netns_and_gc_reads_the_valid_attachments() -> None:
    assert parse_call({**ENV, "CNI_COMMAND": "DEL", "CNI_NETNS": ""}, CONF).netns == ""
    gc = parse_call({"CNI_COMMAND": "GC"}, json.dumps({
        "cniVersion": "1.1.0", "name": "pods",
        "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}))
    assert gc.valid == frozenset({("a", "eth0")})


@pytest.mark.parametrize("listed", [
    {"cni.dev/valid-attachments": None, "cni.dev/attachments": None},  # CRI-O with no pods
    {"cni.dev/valid-attachments": None},
    {},
    {"cni.dev/valid-attachments": []},
])
def test_a_gc_whose_list_is_null_or_absent_keeps_nothing_as_an_empty_list_does(
        listed: dict[str, Any]) -> None:
    gc = parse_call({"CNI_COMMAND": "GC"}, json.dumps({"cniVersion": "1.1.0", "name": "pods",
                                                      **listed}))
    assert gc.valid == frozenset()


def test_a_gc_reads_the_older_key_when_the_new_one_is_null() -> None:
    gc = parse_call({"CNI_COMMAND": "GC"}, json.dumps({
        "cniVersion": "1.1.0", "name": "pods", "cni.dev/valid-attachments": None,
        "cni.dev/attachments": [{"containerID": "a", "ifname": "eth0"}]}))
    assert gc.valid == frozenset({("a", "eth0")})


def test_cni_args_keep_their_order_and_empty_items_are_ignored() -> None:
    assert parse_cni_args("A=1;;B=x=y;") == (("A", "1"), ("B", "x=y"))


def test_agent_errors_map_to_codes_a_runtime_acts_on() -> None:
    add, check = ShimCall("ADD", "1.0.0"), ShimCall("CHECK", "1.0.0")

    def code(call: ShimCall, e: BaseException) -> tuple[int, str]:
        doc = json.loads(failure_answer(call, e).output)
        assert doc["cniVersion"] == "1.0.0"
        return doc["code"], doc["msg"]

    inner = PluginError("bridge", "ADD", 7, "bad subnet", "10.0.0.0/33")
    wrapped = AgentError(ErrorKind.PLUGIN_FAILED, str(inner))
    wrapped.__cause__ = inner
    doc = json.loads(failure_answer(add, wrapped).output)
    assert (doc["code"], doc["msg"], doc["details"]) == (7, "bad subnet", "10.0.0.0/33")
    assert code(add, AgentError(ErrorKind.NOT_READY, "no network"))[0] == 11
    assert code(add, AgentError(ErrorKind.BUSY, "locked"))[0] == 11
    assert code(add, AgentError(ErrorKind.SHUTTING_DOWN, "stopping"))[0] == 11
    assert code(add, InvalidArgument("sandbox_id", "bad")) == (4, "CNI_CONTAINERID: bad")
    assert code(add, InvalidArgument("network", "bad"))[0] == 7
    assert code(check, AgentError(ErrorKind.NOT_FOUND, "none"))[0] == 3
    assert code(add, AgentError(ErrorKind.NOT_FOUND, "no network x"))[0] == 7
    assert code(add, AgentError(ErrorKind.TIMEOUT, "bridge timed out"))[0] == 999
    # The agent's own disk: a condition that passes; an ADD refused for it
    # changed nothing, a DEL answered with it released the network (issue 36).
    state = AgentError(ErrorKind.STATE_ERROR, "not recorded: the record's removal")
    assert code(add, state)[0] == 11 and code(ShimCall("DEL", "1.0.0"), state)[0] == 11


def test_an_error_raised_from_itself_is_answered() -> None:
    # `raise e from e` makes a cycle of causes; walking it must end.
    e = AgentError(ErrorKind.NOT_FOUND, "sandbox c has no eth0")
    e.__cause__ = e
    assert json.loads(failure_answer(ShimCall("CHECK"), e).output)["code"] == 3


def test_the_c_shim_answers_version_with_the_agents_list() -> None:
    source = (REPO / "shim" / "cni-agent-shim.c").read_text()
    line = re.search(r'#define SUPPORTED_VERSIONS "(.*)"', source)
    assert line is not None
    assert json.loads("[" + line.group(1).replace('\\"', '"') + "]") == list(SHIM_VERSIONS)


def test_shim_config_is_a_conflist_a_runtime_loads() -> None:
    doc = conflist("bridge-firewalld")
    assert doc["name"] == "bridge-firewalld" and doc["cniVersion"] == "1.0.0"
    assert doc["plugins"][0]["type"] == "cni-agent-shim"
    assert doc["plugins"][0]["network"] == "bridge-firewalld"
    assert doc["plugins"][0]["capabilities"]["portMappings"] is True
    assert conflist(name="pods")["plugins"][0]["network"] == ""
