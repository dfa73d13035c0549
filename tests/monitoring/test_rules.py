"""packaging/monitoring: the alerting rules pass `promtool test rules`, and the
dashboard is one Grafana can import and filter. (Their queries against a live
agent: tests/daemon/test_fleet_view.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from cni_agent.readiness.reasons import REASONS
from tests.support.agent import REPO
from tests.support.docs import anchors, section
from tests.support.promql import selectors

PROMTOOL = shutil.which("promtool") or "/var/cache/cni-agent-tests/promtool/promtool"
MONITORING = REPO / "packaging" / "monitoring"
RULES = MONITORING / "cni-agent-alerts.yml"
DASHBOARD = MONITORING / "cni-agent-dashboard.json"
UNIT_TESTS = Path(__file__).parent / "cni-agent-alerts.test.yml"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
# Each runbook_url: the operator's base (an external label) or the package's
# copy of docs/, then the page and the rule's section.
RUNBOOK = re.compile(r'\{\{ or \$externalLabels\.cni_agent_docs_url "(?P<default>[^"]+)" \}\}'
                     r"/troubleshooting\.md#(?P<anchor>[a-z0-9-]+)")


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


def test_every_rule_has_a_runbook_whose_section_exists() -> None:
    """The anchors as GitHub and GitLab make them from the headings (the test of
    the docs' own links uses the same slugs)."""
    sections = anchors(TROUBLESHOOTING.read_text())
    for rule in rules():
        url = rule["annotations"].get("runbook_url", "")
        m = RUNBOOK.fullmatch(url)
        assert m, f"{rule['alert']}: runbook_url {url!r} is not the base + troubleshooting.md#SECTION"
        assert m["anchor"] in sections, f"{rule['alert']}: no section #{m['anchor']} in troubleshooting.md"
        assert m["default"] == "file:///usr/share/doc/cni-agent/docs", rule["alert"]


def test_the_default_runbook_base_is_where_the_packages_put_the_page() -> None:
    """Without the external label the runbook is the installed copy: both
    packages install docs/ as it is in the tree, /usr/share/doc/cni-agent/docs/."""
    debian = (REPO / "packaging" / "debian" / "cni-agent.docs").read_text().split()
    assert "docs" in debian  # dh_installdocs: the directory, kept whole
    spec = (REPO / "packaging" / "rpm" / "cni-agent.spec").read_text()
    assert re.search(r"^%doc docs$", spec, re.M)  # likewise
    assert (REPO / "docs" / "troubleshooting.md").is_file()


def test_the_unit_tests_render_the_runbook_under_an_operators_base() -> None:
    groups = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    assert any("cni_agent_docs_url" in g.get("external_labels", {}) for g in groups)


def test_every_not_ready_reason_is_explained_where_the_alert_sends_you() -> None:
    page = section(TROUBLESHOOTING.read_text(), "NetworkReady is false")
    for reason in REASONS:
        assert f"**{reason}**" in page, reason
    described = next(r for r in rules() if r["alert"] == "CNIAgentNetworkNotReady")
    for reason in REASONS:
        assert reason in described["annotations"]["description"], reason


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

