"""The shipped fleet view against a real Prometheus scraping a real agent.

packaging/monitoring holds a Grafana dashboard and Prometheus alerting rules.
Here a real Prometheus (tests/support/prometheus.py) scrapes an agent's
`http.listen` every second and evaluates the rules, while the agent does real
Setups, Teardowns and shim calls and meets the faults the alerts are about
(the test plugin's control file): every dashboard query then returns data,
every rule evaluates cleanly and reads only series the agent exports, and the
alerts for the faults made become active in Prometheus. The rules' logic over
time (thresholds, `for`, windows) is tests/monitoring/cni-agent-alerts.test.yml's.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemon.conftest import plug
from tests.support.agent import REPO, Agent
from tests.support.plugins import Control
from tests.support.prometheus import Prometheus, free_port, has_number
from tests.support.promql import selectors
from tests.support.shim import run_shim, shim_conf

pytestmark = pytest.mark.root

MONITORING = REPO / "packaging" / "monitoring"
RULES = MONITORING / "cni-agent-alerts.yml"
DASHBOARD = MONITORING / "cni-agent-dashboard.json"
# What Grafana puts in for the dashboard's variables: the job, all nodes, and a
# rate window that spans the whole run (so a rate() has its samples).
VARIABLES = {"$__rate_interval": "1m", "$job": "cni-agent", "$instance": ".*"}
# What CNIAgentNodeMissing reads besides the agents: node_exporter's targets and
# the operator's own list (docs/monitoring.md); no agent exports them.
ELSEWHERE = {'up{job="node"}', "cni_agent:expected_node"}


def grafana(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a dashboard variable the test does not know: {expr}"
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' panels included."""
    doc = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))

    walk(doc["panels"])
    return out


def variable_queries() -> list[tuple[str, str, str]]:
    """(variable, selector, label) of the dashboard's label_values() variables."""
    doc = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str, str]] = []
    for v in doc["templating"]["list"]:
        if v["type"] == "query":
            inner = v["query"]["query"].removeprefix("label_values(").removesuffix(")")
            selector, _, label = inner.rpartition(",")
            out.append((v["name"], selector.strip(), label.strip()))
    return out


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Callable[[int], Prometheus]]:
    servers: list[Prometheus] = []

    def start(port: int) -> Prometheus:
        servers.append(Prometheus(tmp_path, [f"127.0.0.1:{port}"], [RULES]))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_dashboard_queries_and_alert_rules_work_on_a_live_agent(
    make_agent: Callable[..., Agent], testnet: Callable[..., Path], control: Control,
    netns_factory: Callable[[], str], prometheus_for: Callable[[int], Prometheus],
    tmp_path: Path,
) -> None:
    testnet()  # the default network
    other = Control(tmp_path / "other-control.json")  # a second network, faulted on its own
    testnet("other", filename="60-other.conflist", plugins=[plug(other)])
    # A network with a host-local pool the agent counts (the test plugin never
    # leases from it): the ipam series the capacity alert reads exist.
    testnet("pool", filename="65-pool.conflist", plugins=[plug(
        Control(tmp_path / "pool-control.json"),
        ipam={"type": "host-local", "subnet": "10.147.40.0/29", "dataDir": str(tmp_path)})])
    port = free_port()
    agent = make_agent(http={"listen": f"127.0.0.1:{port}"},
                       check={"interval": 1, "repair": True}, gc={"interval": 1},
                       timeouts={"ready": 2, "lock": 5, "add": 2})
    prom = prometheus_for(port)
    prom.wait('up{job="cni-agent"} == 1')
    start = time.time()

    # Work as a node does it: Setups and Teardowns on D-Bus, ADD and DEL through
    # the shim; twice, a scrape apart, so that rate() has a change to see.
    a, b, c, k = (netns_factory() for _ in range(4))
    conf = shim_conf("pods", "testnet")
    for sid, ns in (("a", a), ("b", b), ("c", c)):
        agent.setup(sid, ns)
        if sid == "a":
            agent.call("Teardown", "ssa{sv}", "a", a, "0")
            for command in ("ADD", "DEL"):
                assert run_shim(agent.bus.address, command, conf, cid="k", netns=k).rc == 0
            prom.wait('cni_agent_shim_calls_total{command="DEL"}')
    agent.call("Teardown", "ssa{sv}", "a", a, "0")
    for command in ("ADD", "DEL"):
        assert run_shim(agent.bus.address, command, conf, cid="k", netns=k).rc == 0

    # A plugin that fails ADD, then one that hangs past timeouts.add; the first
    # of each is scraped alone, so increase() sees the ones after it.
    control.set("ADD", "fail", code=11, msg="no free addresses")
    for n in range(5):
        assert "PluginFailed" in agent.gdbus("Setup", f"f{n}", a, "{}").stderr
        if n == 0:
            prom.wait('cni_agent_plugin_executions_total{result="code_11"}')
    control.set("ADD", "succeed", sleep=5)
    for n in range(3):
        assert "Timeout" in agent.gdbus("Setup", f"t{n}", a, "{}").stderr
        if n == 0:
            prom.wait('cni_agent_plugin_executions_total{result="timeout"}')
    control.clear("ADD")

    # Drift: b and c passed their baseline CHECK; now CHECK fails. Their repair is
    # refused (the network does not declare the ips capability).
    control.set("CHECK", "fail", code=99, msg="the veth is gone")
    prom.wait('cni_agent_repairs_total{result="refused"} > 0')
    control.clear("CHECK")

    # A namespace deleted behind the agent's back: the next reaping pass frees it.
    doomed = netns_factory()
    agent.setup("doomed", doomed)
    subprocess.run(["ip", "netns", "delete", Path(doomed).name], check=True)
    prom.wait('cni_agent_gc_attachments_total{how="deleted"} > 0')

    # A Teardown whose DEL fails: c stays tearing-down.
    control.set("DEL", "fail", code=11, msg="the IPAM store is read-only")
    assert "PluginFailed" in agent.gdbus("Teardown", "c", c, "{}").stderr

    # A configuration file that does not load, and a second network failing STATUS.
    (agent.conf_dir / "70-broken.conflist").write_text("{ not json")
    other.set("STATUS", "fail", code=50, msg="the storage daemon is down")
    # A runtime whose shim conflist names a network the agent does not have.
    for n in range(3):
        reply = run_shim(agent.bus.address, "ADD", shim_conf("pods", "nosuchnet"), cid=f"x{n}",
                         netns=k)
        assert reply.code == 7, reply
    prom.wait("cni_agent_invalid_networks > 0")
    prom.wait('cni_agent_network_status_ready{network="other"} == 0')
    end = time.time()

    # Every metric the dashboard and the rules read is one the agent exports.
    exprs = [grafana(e) for _, e in dashboard_queries()] + [r["expr"] for r in alert_rules()]
    read = {m.group() for expr in exprs for sel in selectors(expr)
            if sel not in ELSEWHERE and (m := re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", sel))}
    exported = set(prom.api("label/__name__/values"))
    assert read - exported == set(), f"read but not exported: {sorted(read - exported)}"

    # Every panel's query returns data over the run, and the variables find the node.
    for title, expr in dashboard_queries():
        result = prom.query_range(grafana(expr), start, end)
        assert result and has_number(result), f"panel {title!r}: no data for {expr}"
        for selector in selectors(grafana(expr)):
            assert prom.query(selector), f"panel {title!r}: no series {selector}"
    for name, selector, label in variable_queries():
        found = prom.query(grafana(selector))
        assert any(s["metric"].get(label) for s in found), f"variable {name}: nothing in {selector}"

    # Every rule: loaded, evaluated without error, reading series the agent has.
    rules = alert_rules()
    loaded = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in rules}
    for rule in rules:
        assert loaded[rule["alert"]]["health"] == "ok", loaded[rule["alert"]]
        prom.query(rule["expr"])
        for selector in set(selectors(rule["expr"])) - ELSEWHERE:
            assert prom.query(selector), f"{rule['alert']}: no series {selector}"

    # The faults made are the alerts raised (pending while their `for` runs), at
    # the next evaluation of the rules.
    for name in ("CNIAgentPluginErrors", "CNIAgentPluginTimeouts", "CNIAgentDriftDetected",
                 "CNIAgentRepairsFailing", "CNIAgentSandboxStuckTearingDown",
                 "CNIAgentInvalidNetworkConfig", "CNIAgentNetworkStatusFailing",
                 "CNIAgentShimErrors"):
        prom.wait_alert(name, timeout=5)
    active = prom.active_alerts()
    for name in ("CNIAgentDown", "CNIAgentNetworkNotReady", "CNIAgentMissing",
                 "CNIAgentRestarting", "CNIAgentStateErrors", "CNIAgentNodeMissing"):
        assert name not in active, (name, active)

    # The default network fails STATUS: NetworkReady false is alerted, and the
    # second network's failure is no longer alerted on its own.
    control.set("STATUS", "fail", code=50, msg="the daemon is down")
    prom.wait_alert("CNIAgentNetworkNotReady")
    # The description is rendered at each evaluation from the reason's latest
    # sample: the first one may come from a scrape taken between NetworkReady
    # going false and the monitor naming why (seen once in CI: "unknown").
    deadline = time.monotonic() + 10
    while True:
        [alert] = [a for a in prom.api("alerts")["alerts"]
                   if a["labels"]["alertname"] == "CNIAgentNetworkNotReady"]
        if "(reason: status_failed)" in alert["annotations"]["description"] \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "(reason: status_failed)" in alert["annotations"]["description"], alert
    assert alert["annotations"]["runbook_url"] == \
        "file:///usr/share/doc/cni-agent/docs/troubleshooting.md#networkready-is-false"
    prom.wait("cni_agent_network_ready == 0")
    time.sleep(1.5)  # one more evaluation
    assert "CNIAgentNetworkStatusFailing" not in prom.active_alerts()

    # The agent killed: its target is down.
    assert agent.proc is not None
    agent.proc.kill()
    prom.wait_alert("CNIAgentDown")
