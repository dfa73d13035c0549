"""packaging/monitoring: the alerting rules pass `promtool test rules`, and the
dashboard is one Grafana can import and filter. (Their queries against a live
agent: tests/daemon/test_fleet_view.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.agent import REPO
from tests.support.promql import selectors

PROMTOOL = shutil.which("promtool") or "/var/cache/cni-agent-tests/promtool/promtool"
MONITORING = REPO / "packaging" / "monitoring"
RULES = MONITORING / "cni-agent-alerts.yml"
DASHBOARD = MONITORING / "cni-agent-dashboard.json"
UNIT_TESTS = Path(__file__).parent / "cni-agent-alerts.test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_load() -> None:
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    out = promtool("test", "rules", str(UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_is_unit_tested_firing_and_quiet_and_says_what_to_do() -> None:
    cases = [case for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
             for case in t.get("alert_rule_test", [])]
    for rule in rules():
        name = rule["alert"]
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in mine), f"{name}: no unit test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{name}: no unit test where it is quiet"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_the_selector_finder_reads_what_promql_reads() -> None:
    """The live test checks each selector this finds; it must find them all."""
    expr = ('sum by (job, instance) (increase(a_total{x="1", y=~"a|b"}[1h])) >= 3 '
            'unless on (job) max without (le) (rate(b_bucket[5m] offset 10m)) '
            '/ ignoring (le) group_left c and histogram_quantile(0.9, d{e!="}"}) '
            'or absent({__name__="f"}) or vector(0) > bool 1e3')
    assert selectors(expr) == ['a_total{x="1", y=~"a|b"}', "b_bucket", "c", 'd{e!="}"}',
                               '{__name__="f"}']
    assert selectors('min_over_time((sum(rate(g[1m])))[1h:5m])') == ["g"]


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_the_dashboard_imports_and_every_panel_follows_its_variables() -> None:
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels(doc):
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
            for sel in selectors(t["expr"]):
                # Each series read is the chosen job's and nodes'.
                assert 'job="$job"' in sel and 'instance=~"$instance"' in sel, (p["title"], sel)

