"""A real Prometheus scraping `kvtier serve`: the exposition passes
promtool, rate() and histogram_quantile() come back through the HTTP API,
and every query of the Grafana dashboard runs and names only metrics we
export."""

import json
import pathlib
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import kvtier
import pytest

from conftest import REPO, tool, wait_for

DASHBOARD = REPO / "deploy" / "grafana" / "kvtier.json"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exported_families(exposition):
    """Metric family names declared in a classic text exposition."""
    return {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}


def sample_names(exposition):
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in exposition.splitlines() if line and not line.startswith("#")}


def dashboard_queries():
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def concrete(expr):
    """A dashboard query as Grafana would send it for "all servers"."""
    return expr.replace("$instance", ".*").replace("$__rate_interval", "10s")


@pytest.fixture
def prometheus(cluster):
    """A real Prometheus scraping both cluster nodes every second."""
    binary = tool("prometheus", "prometheus")
    directory = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-prometheus-"))
    targets = ", ".join(f"'{node.admin.removeprefix('http://')}'" for node in cluster)
    (directory / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        f"scrape_configs:\n  - job_name: kvtier\n    static_configs:\n      - targets: [{targets}]\n"
    )
    port = free_port()
    log = open(directory / "prometheus.log", "w")
    process = subprocess.Popen(
        [binary, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready():
        if process.poll() is not None:
            pytest.fail(f"prometheus exited: {(directory / 'prometheus.log').read_text()[-3000:]}")
        try:
            return urllib.request.urlopen(url + "/-/ready", timeout=2).status == 200
        except OSError:
            return False

    wait_for(ready, "prometheus to be ready", timeout=60)
    yield url
    process.terminate()
    process.wait(timeout=30)
    log.close()
    shutil.rmtree(directory, ignore_errors=True)


def query(prometheus, expr):
    with urllib.request.urlopen(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=10) as r:
        answer = json.loads(r.read())
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def keep_reading(server, stop):
    """Gets (hits and a miss) until told to stop, so rates stay above 0."""
    with kvtier.Client(server.unix, shm_size="16MiB") as client:
        for i in range(16):
            client.put(f"k{i}".encode(), bytes([i]) * (64 << 10))
        while not stop.is_set():
            for i in range(16):
                assert client.get(f"k{i}".encode()) == bytes([i]) * (64 << 10)
            assert client.get(b"absent") == b""
            time.sleep(0.05)


def test_promtool_accepts_the_exposition(server):
    exposition = server.get("/metrics")
    result = subprocess.run([tool("promtool", "prometheus"), "check", "metrics"], input=exposition,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == "", result.stdout + result.stderr


def test_prometheus_scrapes_rates_quantiles_and_the_dashboard_queries(cluster, prometheus):
    # Traffic through node 1: about half its keys live on node 2, so the
    # peer metrics move too.
    server = cluster[0]
    stop = threading.Event()
    reader = threading.Thread(target=keep_reading, args=(server, stop))
    reader.start()
    try:
        # rate() needs two scrapes inside its window after traffic began.
        rate = wait_for(lambda: [r for r in query(prometheus, 'sum(rate(kvtier_requests_total{op="batch_get"}[10s]))')
                                 if float(r["value"][1]) > 0], "a positive get rate", timeout=60)
        p99 = wait_for(lambda: [r for r in query(
            prometheus,
            'histogram_quantile(0.99, sum by (le) (rate(kvtier_request_duration_seconds_bucket{op="batch_get"}[10s])))')
            if r["value"][1] not in ("NaN", "+Inf") and float(r["value"][1]) > 0], "a get p99", timeout=30)
        # The windows fill as scrapes come in: wait (bounded) for each figure
        # while the traffic runs.
        hit_rate = wait_for(lambda: [r for r in query(
            prometheus, concrete(next(e for t, e in dashboard_queries() if t == "Hit rate")))
            if 0.8 < float(r["value"][1]) < 1.0], "a hit rate of 16 hits per miss", timeout=30)
        peers = wait_for(lambda: [r for r in query(prometheus, 'sum(rate(kvtier_peer_requests_total[10s]))')
                                  if float(r["value"][1]) > 0], "calls from node 1 to node 2", timeout=30)
    finally:
        stop.set()
        reader.join(timeout=60)
    print(f"get rate {float(rate[0]['value'][1]):.1f}/s, p99 {float(p99[0]['value'][1]) * 1e3:.3f} ms, "
          f"hit rate {float(hit_rate[0]['value'][1]):.3f}, calls to the peer {float(peers[0]['value'][1]):.1f}/s")
    # Every scrape of both nodes succeeded.
    scrapes = query(prometheus, 'count_over_time(up{job="kvtier"}[1m])')
    ok = query(prometheus, 'sum_over_time(up{job="kvtier"}[1m])')
    assert len(scrapes) == 2 and [r["value"][1] for r in scrapes] == [r["value"][1] for r in ok], (scrapes, ok)
    up = query(prometheus, 'up{job="kvtier"}')
    assert [r["value"][1] for r in up] == ["1", "1"], up
    # Every dashboard query parses and runs on Prometheus, and returns data.
    exposition = server.get("/metrics") + cluster[1].get("/metrics")
    empty = []
    for title, expr in dashboard_queries():
        if not query(prometheus, concrete(expr)):
            empty.append((title, expr))
    assert not empty, f"dashboard queries with no data: {empty}"
    # ...and names only metrics this server exports.
    names = sample_names(exposition)
    for title, expr in dashboard_queries():
        for name in re.findall(r"\bkvtier_[a-z0-9_]+", expr):
            assert name in names, f"panel {title!r} names {name}, which /metrics does not export"
