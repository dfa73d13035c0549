"""Every call gets a reply, whatever a plugin printed (issue 36, item 1).

A NUL byte or invalid UTF-8 in a plugin's output or error message used to make
the reply unmarshallable: the agent did the work but the caller waited for its
own D-Bus timeout. Here each verb's plugin prints such text and the caller,
through D-Bus and through the shim, gets a named error well before its own
timeout (CLIENT_TIMEOUT: a bound, not a speed goal).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from dbus_fast import Message
from dbus_fast.aio import MessageBus

from tests.support.agent import NAME, PATH, Agent, Bus
from tests.support.plugins import Control, wait_for
from tests.support.shim import SHIM, run_shim, shim_conf, shim_env

pytestmark = pytest.mark.root
ERR = "org.cniagent.Agent1.Error."
CLIENT_TIMEOUT = 20  # the caller's own D-Bus timeout: hitting it is the defect
# NUL, a lone surrogate (as JSON can spell it) and a control character.
NASTY = "bad\u0000msg \ud800 \u0007end"


def gdbus(agent: Agent, method: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["gdbus", "call", "--address", agent.bus.address, "--dest", NAME, "--object-path", PATH,
         "--timeout", str(CLIENT_TIMEOUT), "--method", f"org.cniagent.Agent1.{method}", *args],
        capture_output=True, text=True, timeout=CLIENT_TIMEOUT + 10)


def assert_named(out: subprocess.CompletedProcess[str], error: str, *words: str) -> None:
    assert out.returncode != 0, out
    assert "Timeout was reached" not in out.stderr and "NoReply" not in out.stderr, out.stderr
    assert f"{ERR}{error}" in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


GARBAGE = [
    ("nul-text", {"action": "garbage", "output": "{not json\u0000 at all"}),
    ("raw-bytes", {"action": "garbage", "output_hex": "7b00ff fe 41 00c3 28".replace(" ", "")}),
]


@pytest.mark.parametrize(("name", "action"), GARBAGE, ids=[g[0] for g in GARBAGE])
def test_an_add_printing_garbage_with_nul_bytes_gets_a_named_error(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str, name: str, action: dict[str, str],
) -> None:
    testnet()
    agent = make_agent()
    control.set("ADD", **action)
    assert_named(gdbus(agent, "Setup", f"g-{name}", netns, "{}"), "PluginFailed",
                 "output is not JSON")
    assert agent.call("ListSandboxes")[0] == []  # rolled back, as any failed ADD
    # The same plugin behind the shim: a CNI error on stdout, valid JSON.
    reply = run_shim(agent.bus.address, "ADD", shim_conf("pods", "testnet"), cid=f"s-{name}",
                     netns=netns, timeout=CLIENT_TIMEOUT)
    assert reply.rc == 1 and "output is not JSON" in reply.out["msg"], reply


def test_an_error_message_with_nul_gets_a_named_error_for_add_del_and_check(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str,
) -> None:
    testnet()
    agent = make_agent()
    control.set("ADD", "fail", code=7, msg=NASTY)
    assert_named(gdbus(agent, "Setup", "e1", netns, "{}"), "PluginFailed", "bad", "end")
    shim = run_shim(agent.bus.address, "ADD", shim_conf("pods", "testnet"), cid="e2",
                    netns=netns, timeout=CLIENT_TIMEOUT)
    # The runtime gets the plugin's own error, its text intact in JSON.
    assert (shim.rc, shim.out["code"], shim.out["msg"]) == (1, 7, NASTY), shim
    control.clear("ADD")

    agent.setup("e1", netns)
    assert run_shim(agent.bus.address, "ADD", shim_conf("pods", "testnet"), cid="e2",
                    netns=netns).rc == 0
    control.set("CHECK", "fail", code=7, msg=NASTY)
    assert_named(gdbus(agent, "Check", "e1", netns, "{}"), "PluginFailed", "bad", "end")
    shim = run_shim(agent.bus.address, "CHECK", shim_conf("pods", "testnet"), cid="e2",
                    netns=netns, timeout=CLIENT_TIMEOUT)
    assert (shim.rc, shim.out["code"], shim.out["msg"]) == (1, 7, NASTY), shim

    control.set("DEL", "fail", code=7, msg=NASTY)
    assert_named(gdbus(agent, "Teardown", "e1", netns, "{}"), "PluginFailed", "bad", "end")
    shim = run_shim(agent.bus.address, "DEL", shim_conf("pods", "testnet"), cid="e2",
                    netns=netns, timeout=CLIENT_TIMEOUT)
    # A failed DEL is the agent's "incomplete, entry kept", quoting the plugin.
    assert shim.rc == 1 and shim.out["msg"].endswith(NASTY), shim
    # Nothing was lost on the way: the failed DELs left both sandboxes, and
    # Show (JSON, so its strings are escaped) answers for them.
    assert sorted(agent.call("ListSandboxes")[0]) == ["e1", "e2"]
    control.clear("DEL")
    agent.call("Teardown", "ssa{sv}", "e1", netns, "0")
    assert run_shim(agent.bus.address, "DEL", shim_conf("pods", "testnet"), cid="e2",
                    netns=netns).rc == 0


def test_a_result_holding_nul_survives_setup_and_show(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns: str,
) -> None:
    testnet()
    agent = make_agent()
    dns = {"domain": "a\u0000b", "search": ["\ud800x"]}
    control.set("ADD", "succeed", dns=dns)
    result = agent.setup("r1", netns)
    assert result["attachments"][0]["result"]["dns"] == dns
    shown = json.loads(agent.call("Show", "s", "r1")[0])
    assert shown["attachments"][0]["result"]["dns"] == dns


def test_a_status_error_with_nul_leaves_the_properties_readable(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
) -> None:
    testnet()
    agent = make_agent()
    control.set("STATUS", "fail", code=50, msg=NASTY)
    wait_for(lambda: agent.prop("NetworkReady") is False)
    for prop in ("LastError", "Status"):
        out = agent.busctl("--timeout=10", "get-property", NAME, PATH, "org.cniagent.Agent1",
                           prop, check=False)
        assert out.returncode == 0 and "bad" in out.stdout and "end" in out.stdout, out
    assert agent.notify is not None
    wait_for(lambda: any(line.startswith("STATUS=") and "bad" in line and "end" in line
                         for line in agent.notify.lines()))
    assert agent.call("ListSandboxes")[0] == []
    control.clear("STATUS")
    wait_for(lambda: agent.prop("NetworkReady") is True)


def test_the_shim_prints_valid_json_whatever_the_agent_answers(permissive_bus: Bus) -> None:
    """The shim's own guard: a refusal's message is cut to fit its buffer, and a
    cut through a multi-byte character must not reach the runtime as invalid
    UTF-8 (its JSON would not parse). A stand-in owns the agent's name and
    refuses CNICall with a long message of two-byte characters."""
    message = "é" * 1000
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def own() -> MessageBus:
        bus = await MessageBus(bus_address=permissive_bus.address).connect()

        def refuse(msg: Message) -> Message | None:
            if msg.member != "CNICall":
                return None
            return Message.new_error(msg, "org.cniagent.Agent1.Error.PluginFailed", message)

        bus.add_message_handler(refuse)
        await bus.request_name(NAME)
        return bus

    bus = asyncio.run_coroutine_threadsafe(own(), loop).result(10)
    try:
        env = shim_env(permissive_bus.address, "ADD", cid="c", netns="/run/netns/x")
        p = subprocess.run([str(SHIM)], input=json.dumps(shim_conf("pods")).encode(), env=env,
                           capture_output=True, timeout=30)
        assert p.returncode == 1
        out = json.loads(p.stdout.decode("utf-8"))  # strict: invalid UTF-8 raises
        assert out["code"] == 999 and out["msg"].startswith("cni-agent refused the call: ééé")
    finally:
        bus.disconnect()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
