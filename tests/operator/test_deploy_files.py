"""The deployment examples: the Grafana dashboard is well-formed for
Grafana's dashboard schema and names only exported metrics; the systemd
unit passes systemd-analyze; the Prometheus example parses."""

import json
import re
import subprocess
import pathlib

import kvtier

from conftest import REPO, kvtier_binary, tool

DASHBOARD = REPO / "deploy" / "grafana" / "kvtier.json"
# Panel types Grafana 10+ ships (the dashboard may use no plugin panels).
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "row", "text", "heatmap", "barchart", "piechart"}


def test_dashboard_is_a_grafana_dashboard_over_our_metrics(cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    for field, kind in [("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                        ("templating", dict), ("time", dict), ("refresh", str), ("version", int)]:
        assert isinstance(dashboard.get(field), kind), field
    assert 36 <= dashboard["schemaVersion"] <= 41 and len(dashboard["uid"]) <= 40
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "kvtier_build_info" in variables["instance"]["definition"]
    ids, cells = set(), set()
    # A cluster node exports every metric (the single-node ones and the
    # cluster's); its peer families appear once it has called a peer.
    with kvtier.Client(cluster[0].unix) as client:
        keys = [f"k{i}".encode() for i in range(16)]
        for key in keys:
            client.put(key, b"x" * 4096)
    exported = {re.split(r"[{ ]", line, maxsplit=1)[0]
                for line in cluster[0].get("/metrics").splitlines() if line and not line.startswith("#")}
    named = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["type"]
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "xywh") and grid["x"] + grid["w"] <= 24 and grid["w"] > 0
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another at {(x, y)}"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            for name in re.findall(r"\bkvtier_[a-z0-9_]+", target["expr"]):
                named.add(name)
                assert name in exported, f"panel {panel['title']!r} names {name}, which /metrics does not export"
    # The dashboard covers what an operator asks first.
    for needed in ["kvtier_hits_total", "kvtier_misses_total", "kvtier_request_duration_seconds_bucket",
                   "kvtier_tier_used_bytes", "kvtier_evictions_total", "kvtier_checksum_failures_total",
                   "kvtier_retrying_writes"]:
        assert needed in named, needed


def test_systemd_unit_verifies_and_is_hardened(tmp_path):
    analyze = tool("systemd-analyze", "systemd")
    unit = (REPO / "deploy" / "kvtier.service").read_text()
    directory = tmp_path
    path = directory / "kvtier.service"
    path.write_text(unit.replace("/usr/local/bin/kvtier", kvtier_binary()))
    result = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
    result = subprocess.run([analyze, "security", "--offline=true", str(path)], capture_output=True, text=True,
                            timeout=60)
    score = re.search(r"Overall exposure level for kvtier.service: ([0-9.]+)", result.stdout)
    assert score, result.stdout[-2000:] + result.stderr
    print("systemd-analyze security exposure:", score.group(1))
    assert float(score.group(1)) <= 2.0, result.stdout


def test_prometheus_example_config_parses():
    promtool = tool("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "config", str(REPO / "deploy" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
