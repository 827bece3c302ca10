"""The status page, rendered by headless Chromium: what it shows must be
what /stats and /stats/history report."""

import decimal
import html.parser
import http.server
import subprocess
import threading
import time
import urllib.request

import pytest

from conftest import ARTIFACTS, drive_traffic, tool, wait_for  # noqa: F401


class Dom(html.parser.HTMLParser):
    """Every element with an id or a data-key, with its attributes and text."""

    def __init__(self, markup):
        super().__init__()
        self.by_key, self.by_id, self.lines, self.legend = {}, {}, [], {}
        self.body = {}
        self.open = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        node = {"tag": tag, "attrs": attrs, "text": ""}
        if tag == "body":
            self.body = attrs
        if "data-key" in attrs:
            self.by_key[attrs["data-key"]] = node
        if "id" in attrs:
            self.by_id[attrs["id"]] = node
        if tag == "polyline":
            self.lines.append(node)
        if tag == "span" and "data-field" in attrs:
            self.legend.setdefault(attrs["data-field"], []).append(node)
        if tag not in ("meta", "link", "line", "polyline", "input", "br"):
            self.open.append(node)

    def handle_endtag(self, tag):
        if tag in ("meta", "link", "line", "polyline", "input", "br"):
            return
        while self.open:
            if self.open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for node in self.open:
            node["text"] += data


def chromium(url, *extra, budget_ms=4000):
    result = subprocess.run(
        [tool("chromium", "chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--hide-scrollbars", f"--virtual-time-budget={budget_ms}", *extra, url],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def lookup(stats, key):
    value = stats
    for part in key.split("."):
        value = value[part]
    return value


def to_fixed(x, digits):
    """JavaScript's Number.prototype.toFixed: the exact binary value, a tie
    rounded away from zero (13.25 -> "13.3"; Python's format gives "13.2")."""
    step = decimal.Decimal(1).scaleb(-digits)
    return str(decimal.Decimal(x).quantize(step, rounding=decimal.ROUND_HALF_UP))


def bytes_text(n):
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(units) - 1:
        value /= 1024
        unit += 1
    return f"{n} B" if unit == 0 else f"{to_fixed(value, 1)} {units[unit]}"


# Values that cannot change once the traffic has stopped and been flushed.
STABLE = {
    "store.memory_bytes": "bytes", "store.memory_capacity": "bytes", "store.memory_entries": "count",
    "store.disk_used_bytes": "bytes", "store.disk_capacity": "bytes", "store.disk_entries": "count",
    "store.disk_value_bytes": "bytes", "store.entries": "count", "store.evictions": "count",
    "store.puts": "count", "store.checksum_failures": "count",
    "hit_rate.overall": "percent", "hit_rate.memory": "percent", "hit_rate.disk": "percent",
    "hit_rate.lookups": "count", "latency.get.requests": "count", "latency.put.requests": "count",
    "server.connections": "count", "server.connections_total": "count",
}


def expected_text(value, kind):
    if kind == "bytes":
        return bytes_text(value)
    if kind == "percent":
        return f"{to_fixed(value * 100, 1)}%"
    return f"{value:,}"


def test_page_shows_what_the_stats_report(server):
    done = drive_traffic(server)
    # Two history points after the traffic, so the charts hold it.
    wait_for(lambda: len(server.history()["points"]) >= 3, "three history points")
    before = server.history()
    stats = server.stats()
    assert stats["store"]["evictions"] > 0 and stats["store"]["disk_hits"] > 0, stats["store"]
    assert stats["store"]["misses"] == done["misses"], stats["store"]
    dom = Dom(chromium(server.admin + "/", "--dump-dom"))
    after = server.history()
    assert int(dom.body.get("data-rendered", "0")) >= 1, "the page never rendered the stats"
    assert dom.by_id["state"]["text"].strip() == "serving"
    for key, kind in STABLE.items():
        node = dom.by_key[key]
        value = lookup(stats, key)
        assert node["attrs"]["data-value"] == str(value) or float(node["attrs"]["data-value"]) == value, (key, node, value)
        assert node["text"].strip() == expected_text(value, kind), (key, node["text"], value)
    # Tier fill bars and figures.
    fill = stats["store"]["memory_bytes"] / stats["store"]["memory_capacity"]
    assert dom.by_key["derived.memory_fill"]["text"].strip() == f"{to_fixed(fill * 100, 1)}%"
    width = dom.by_id["memory-fill"]["attrs"]["style"].split("width:")[1].split("%")[0]
    assert abs(float(width) - min(100, fill * 100)) < 0.01, (width, fill)
    # Charts: one line per series, as many points as the history held when
    # the page fetched it (between our two reads), the latest value in the
    # legend one of those the history reports.
    series = {line["attrs"]["data-field"]: int(line["attrs"]["data-points"]) for line in dom.lines}
    for field in ("get_bytes_per_s", "put_bytes_per_s", "get_p50_seconds", "get_p99_seconds",
                  "put_p50_seconds", "put_p99_seconds", "overall", "memory"):
        assert field in series, (field, series)
    assert len(before["points"]) <= series["get_bytes_per_s"] <= len(after["points"]), series
    got = [p["get_bytes_per_s"] for p in after["points"]]
    assert max(got) > 0, "the traffic never reached the history"
    assert max(got) * min(p["seconds"] for p in after["points"]) > 0
    legend = float(dom.legend["get_bytes_per_s"][0]["attrs"]["data-value"])
    assert legend in got, (legend, got)
    # The whole traffic is in the throughput history: values read back.
    served = sum(p["get_bytes_per_s"] * p["seconds"] for p in after["points"])
    assert abs(served - done["values"] * done["size"]) < 1024, (served, done)
    assert "cluster mode is off" in dom.by_id["cluster"]["text"]
    # A picture for people.
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "status-page.png"
    chromium(server.admin + "/", f"--screenshot={shot}", "--window-size=1400,1250")
    assert shot.stat().st_size > 20_000


class FailingProxy(http.server.BaseHTTPRequestHandler):
    """Passes the page and its first stats through, then acts as a server
    that stopped answering (503s), as a stopped kvtier looks from the tab."""

    upstream = ""
    stats_left = 2

    def do_GET(self):
        if self.path.startswith("/stats"):
            if FailingProxy.stats_left <= 0:
                self.send_error(503, "stopped")
                return
            if self.path == "/stats/history":
                FailingProxy.stats_left -= 1
        with urllib.request.urlopen(self.upstream + self.path, timeout=10) as response:
            body = response.read()
            content_type = response.headers["Content-Type"]
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_page_says_so_when_the_server_stops_answering(server):
    drive_traffic(server, values=8, misses=2)
    FailingProxy.upstream = server.admin
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingProxy)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        dom = Dom(chromium(f"http://127.0.0.1:{proxy.server_port}/", "--dump-dom", budget_ms=8000))
    finally:
        proxy.shutdown()
    assert FailingProxy.stats_left == 0
    assert dom.by_id["state"]["text"].strip() == "not answering"
    banner = dom.by_id["banner"]
    assert "hidden" not in banner["attrs"], banner
    assert "stopped answering" in banner["text"] and "retrying" in banner["text"], banner["text"]
    assert "stale" in dom.body.get("class", "")
    # The last figures stay on screen.
    assert dom.by_key["store.puts"]["text"].strip() == "8"


def test_page_lists_the_cluster_members_and_calls_to_them(cluster):
    node1, node2 = cluster
    drive_traffic(node1, values=32, misses=4)  # about half of it lives on node 2
    stats = node1.stats()["cluster"]
    peer_id = next(m["id"] for m in stats["members"] if not m["self"])
    calls = stats["peers"][peer_id]["requests"]
    assert calls > 0, stats["peers"]
    markup = chromium(node1.admin + "/", "--dump-dom")
    dom = Dom(markup)
    text = dom.by_id["cluster"]["text"]
    assert "2 members in view" in text and stats["node_id"][:8] in text, text
    assert 'id="members"' in markup and "hidden" not in dom.by_id["members"]["attrs"]
    for member in stats["members"]:
        assert f'data-member="{member["id"]}"' in markup, member
    row = markup.split(f'data-member="{peer_id}"')[1].split("</tr>")[0]
    cells = [c.split(">", 1)[1] for c in row.split("<td")[1:]]
    cells = [c.split("<", 1)[0] for c in cells]
    assert cells[0] == node2.stats()["cluster"]["address"], cells
    assert int(cells[2].replace(",", "")) >= calls, (cells, calls)
    assert cells[3] == "0", cells
