"""A real Prometheus server for a test: loopback only, its storage in the test's tmp dir.

The binary is the system's, or the one tools/setup-system extracted from
Debian's package (so no Prometheus service ever runs on a developer's machine).
"""

from __future__ import annotations

import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PROMETHEUS = shutil.which("prometheus") or "/var/cache/cni-agent-tests/prometheus/prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """Scrapes `targets` as job "cni-agent" every second and evaluates `rules` every second."""

    def __init__(self, tmp: Path, targets: list[str], rules: list[Path],
                 scrape_configs: list[dict[str, Any]] | None = None) -> None:
        """`scrape_configs`: instead of the plain job "cni-agent" of `targets`."""
        self.dir = tmp / "prometheus"
        self.dir.mkdir()
        config = self.dir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(r) for r in rules],
            "scrape_configs": scrape_configs or [{"job_name": "cni-agent",
                                                  "static_configs": [{"targets": targets}]}],
        }))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.dir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.time()
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"prometheus not ready in 30 s:\n{self.log()}"
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def api(self, path: str, **params: str | float) -> Any:
        """GET /api/v1/PATH; its `data`, after asserting the answer is a success."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=1)
        return list(data["result"])

    def wait(self, expr: str, timeout: float = 15) -> list[dict[str, Any]]:
        """The result of `expr` once it has a series."""
        deadline = time.monotonic() + timeout
        while not (found := self.query(expr)):
            assert time.monotonic() < deadline, f"no series for {expr} in {timeout} s"
            time.sleep(0.2)
        return found

    def active_alerts(self) -> dict[str, str]:
        """alertname -> state (pending or firing) of the alerts active now."""
        return {a["labels"]["alertname"]: a["state"] for a in self.api("alerts")["alerts"]}

    def wait_alert(self, name: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while (state := self.active_alerts().get(name)) is None:
            assert time.monotonic() < deadline, f"alert {name} not active in {timeout} s"
            time.sleep(0.2)
        return state


def has_number(series: list[dict[str, Any]]) -> bool:
    """Whether any sample of a query's result is a number (not NaN: a quantile of nothing)."""
    values = [v for s in series for _, v in s.get("values", [s.get("value", (0, "NaN"))])]
    return any(not math.isnan(float(v)) for v in values)
