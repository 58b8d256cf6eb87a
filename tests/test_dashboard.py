"""`deploy/grafana/harli.json` and `deploy/prometheus/prometheus.yml`: every expression of the
dashboard names only metrics the code exports, every exported metric is on the dashboard, and
the scrape configuration scrapes the three kinds of process with the metrics token."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from api.metrics import METRIC_NAMES as WEB
from gpu_runtime.server.prometheus import METRIC_NAMES as HOST
from workers.metrics import METRIC_NAMES as WORKER

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
NAME = re.compile(r"\b(harli_[a-z0-9_]+)")
EXPORTED = WEB | WORKER | HOST


def expressions(node: Any) -> list[str]:
    """Every `expr` anywhere in the dashboard (panels, rows, nested panels)."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in expressions(value)]
    if isinstance(node, list):
        return [e for item in node for e in expressions(item)]
    return []


def family(sample: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if sample.endswith(suffix) and sample.removesuffix(suffix) in EXPORTED:
            return sample.removesuffix(suffix)
    return sample


def test_every_dashboard_expression_names_exported_metrics_and_covers_them_all() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "harli.json").read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        names = {family(name) for name in NAME.findall(expr)}
        assert names, f"{expr!r} names no harli metric"
        assert names <= EXPORTED, f"{expr!r}: {sorted(names - EXPORTED)} are not exported"
        used |= names
    assert sorted(EXPORTED - used) == [], "exported metrics missing from the dashboard"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_scrape_config_scrapes_web_workers_and_hosts_with_the_token() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert sorted(jobs) == ["harli-host", "harli-web", "harli-worker"]
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        assert job["authorization"]["type"] == "Bearer"
        assert job["authorization"]["credentials_file"]
        assert job["static_configs"][0]["targets"]
