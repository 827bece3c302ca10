"""The operator's view, tested with the real tools: `kvtier serve`, headless
Chromium, Prometheus and promtool, systemd-analyze (CI installs them; a
missing one fails the run and says how to install it)."""

import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

import kvtier

REPO = pathlib.Path(__file__).resolve().parents[2]
# Screenshots and other things worth looking at after a run.
ARTIFACTS = REPO / "target" / "operator"


def tool(name, package):
    """The path of a required command; fails (never skips) without it."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install {package} (scripts/system-packages does it)")
    return path


def kvtier_binary():
    path = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    if not os.path.exists(path):
        pytest.fail(f"the kvtier binary is not built at {path} (cargo build --release)")
    return path


class Server:
    def __init__(self, directory, extra=(), env=None):
        self.directory = directory
        self.process = subprocess.Popen(
            [kvtier_binary(), "serve", "--data-dir", directory, "--memory", "16MiB", "--disk", "256MiB",
             "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", *extra],
            stdout=subprocess.PIPE,
            env={**os.environ, "RUST_LOG": "error", **(env or {})},
            text=True,
        )
        line = self.process.stdout.readline()
        assert line.startswith("kvtier serving"), line
        parts = line.replace(",", " ").split()
        self.unix = next(p for p in parts if p.startswith("unix://"))
        self.admin = next(p for p in parts if p.startswith("http://"))

    def get(self, path, headers=None):
        request = urllib.request.Request(self.admin + path, headers=headers or {})
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()

    def stats(self):
        return json.loads(self.get("/stats"))

    def history(self):
        return json.loads(self.get("/stats/history"))

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            assert self.process.wait(timeout=60) == 0


@pytest.fixture
def server():
    directory = tempfile.mkdtemp(prefix="kvtier-operator-")
    s = Server(directory)
    yield s
    s.stop()
    shutil.rmtree(directory, ignore_errors=True)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster():
    """A one-member etcd and two `kvtier serve --cluster` nodes that see
    each other (the kvtier binary must be built with the cluster feature,
    as scripts/test builds it)."""
    etcd = tool("etcd", "etcd-server")
    directory = tempfile.mkdtemp(prefix="kvtier-operator-cluster-")
    client, peer = free_port(), free_port()
    etcd_process = subprocess.Popen(
        [etcd, "--name", "op", "--data-dir", f"{directory}/etcd",
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"op=http://127.0.0.1:{peer}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    nodes = []
    try:
        for i in (1, 2):
            nodes.append(Server(f"{directory}/node{i}",
                                ["--cluster", "operator", "--etcd", f"http://127.0.0.1:{client}", "--lease-ttl", "2"],
                                env={"KVTIER_AUTH_TOKEN": "operator-cluster-token-0123456789"}))
        wait_for(lambda: all(len(n.stats()["cluster"].get("members", [])) == 2 for n in nodes),
                 "both nodes to see each other", timeout=30)
        yield nodes
    finally:
        for n in nodes:
            n.stop()
        etcd_process.terminate()
        etcd_process.wait(timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def drive_traffic(server, values=96, size=256 << 10, misses=24):
    """Puts `values` values (more than the 16 MiB pool holds, so some are
    evicted and read back from disk), reads every one back, and looks up
    `misses` absent keys. Returns what it did."""
    with kvtier.Client(server.unix, shm_size="64MiB") as client:
        keys = [f"block-{i}".encode() for i in range(values)]
        for i, key in enumerate(keys):
            assert client.put(key, bytes([i % 251]) * size) == 0
        client.flush()
        for i, key in enumerate(keys):
            assert client.get(key) == bytes([i % 251]) * size
        for i in range(misses):
            assert client.get(f"absent-{i}".encode()) == b""
    return {"values": values, "size": size, "misses": misses}


def wait_for(predicate, what, timeout=30.0, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
