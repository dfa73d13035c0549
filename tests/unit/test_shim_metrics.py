"""What the shim's answers count in: cni_agent_shim_calls_total always, the
agent's own codes in cni_agent_shim_errors_total, StateError in
cni_agent_state_errors_total (whose code 11 alone does not tell it from Busy)."""

from __future__ import annotations

from cni_agent.service.cnicall import PLUGIN, Answer
from cni_agent.service.metrics import Metrics


def values(m: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for fam in m.registry.collect()
            for s in fam.samples if s.name == name}


def test_each_answer_is_counted_where_its_kind_belongs() -> None:
    m = Metrics()
    m.shim_call("ADD", Answer(0, "{}"))
    m.shim_call("ADD", Answer(1, "", 7, PLUGIN))  # a plugin's code, passed on
    m.shim_call("ADD", Answer(1, "", 999, "Timeout"))  # a plugin that ran out of time
    m.shim_call("ADD", Answer(1, "", 999, "PluginFailed"))  # one that could not start
    m.shim_call("ADD", Answer(1, "", 11, "Busy"))
    m.shim_call("DEL", Answer(1, "", 11, "StateError"))
    m.shim_call("ADD", Answer(1, "", 7, "NotFound"))  # a network the agent does not have
    m.shim_call("ADD", Answer(1, "", 999, "AccessDenied"))
    m.operation("Setup", "StateError")
    m.operation("Setup", "Busy")
    own = {dict(k)["code"]: v for k, v in values(m, "cni_agent_shim_errors_total").items()}
    assert own == {"1": 0, "3": 0, "4": 0, "6": 0, "7": 1, "11": 2, "50": 0, "999": 1}
    assert values(m, "cni_agent_state_errors_total") == {(): 2}
    calls = values(m, "cni_agent_shim_calls_total")
    assert calls[(("command", "ADD"), ("result", "code_999"))] == 3
    assert calls[(("command", "ADD"), ("result", "ok"))] == 1
