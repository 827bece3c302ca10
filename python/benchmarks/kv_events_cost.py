"""What publishing KV events costs batch puts: four `kvtier serve`
processes, identical but for `--kv-events` on two of them (each with a
pyzmq subscriber draining every batch, as a router would), fed the same
batch puts in rotating rounds from this one process.

    python python/benchmarks/kv_events_cost.py [--rounds 11] [--json out.json] [--smoke]

Each round puts `--batch` values of `--value` bytes through kvtier shared
memory, `--per-round` times (the same keys every round); a round's rate is its bytes over
its time. Reports the median rate of each kind and their ratio;
`--control` runs all four without events (the ratio noise alone gives). Memory
only (the fastest put, where a per-put cost shows most) unless --disk.
Run in the engines' environment (pyzmq): scripts/engine-venv.
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from kvtier import Client

REPO = pathlib.Path(__file__).resolve().parents[2]


def serve(data_dir: pathlib.Path, memory: str, disk: str, events: bool):
    binary = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    cmd = [binary, "serve", "--data-dir", str(data_dir), "--memory", memory, "--disk", disk,
           "--listen", "off", "--admin", "off"]
    if events:
        cmd += ["--kv-events", "tcp://127.0.0.1:0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"})
    line = p.stdout.readline()
    assert line.startswith("kvtier serving"), line
    pub = None
    if events:
        pub = line.split("kv events ")[1].split(",")[0].strip()
    return p, f"unix://{data_dir / 'kvtier.sock'}", pub


def drain(endpoint: str, stop: threading.Event, counts: dict) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(50):
            sub.recv_multipart()
            counts["batches"] += 1
    sub.close(linger=0)
    ctx.term()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-round", type=int, default=32)
    ap.add_argument("--value", type=int, default=64 << 10)
    ap.add_argument("--memory", default="1GiB")
    ap.add_argument("--disk", default="0")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="3 small rounds; checks that events flowed, times nothing")
    ap.add_argument("--no-subscriber", action="store_true", help="publish to nobody (the publisher's own cost)")
    ap.add_argument("--control", action="store_true",
                    help="no server publishes: the ratio noise alone gives (the floor)")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.per_round, args.memory = 3, 2, "512MiB"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-events-bench-"))
    # Four servers started plain, events, events, plain: whatever the start
    # order does to a server (where its pool lands) falls on both kinds.
    kinds = ["plain", "events", "events", "plain"]
    servers = []
    stop, counts = threading.Event(), {"batches": 0}
    try:
        for n, kind in enumerate(kinds):
            events = kind == "events" and not args.control
            process, url, pub = serve(tmp / f"s{n}", args.memory, args.disk, events=events)
            servers.append((kind, process, url))
            if pub is not None and not args.no_subscriber:
                threading.Thread(target=drain, args=(pub, stop, counts), daemon=True).start()
        size = args.batch * args.value
        clients = [Client(url, namespace="bench/kv-events", shm_size=size) for _, _, url in servers]
        staging = [c.alloc_buffer(size) for c in clients]
        for buf in staging:
            memoryview(buf)[:] = os.urandom(size)
        rates = {"plain": [], "events": []}
        per_server = [[] for _ in servers]
        for r in range(args.rounds):
            # Every server in every position over the rounds.
            order = list(range(len(servers)))
            order = order[r % len(order):] + order[:r % len(order)]
            if r % 2:
                order.reverse()
            for n in order:
                client, buf = clients[n], staging[n]
                ptrs = [[buf.ptr + i * args.value] for i in range(args.batch)]
                sizes = [[args.value]] * args.batch
                started = time.perf_counter()
                for j in range(args.per_round):
                    # The same keys every round: overwrites keep the pool's
                    # use flat, and each put is announced again all the same.
                    keys = [f"{j}-{i}" for i in range(args.batch)]
                    codes = client.batch_put_from_multi_buffers(keys, ptrs, sizes)
                    assert all(c == 0 for c in codes), codes[:4]
                elapsed = time.perf_counter() - started
                rates[servers[n][0]].append(size * args.per_round / elapsed / 1e6)
                per_server[n].append(size * args.per_round / elapsed / 1e6)
        time.sleep(0.5)
        result = {
            "value_bytes": args.value, "batch": args.batch, "puts_per_round": args.batch * args.per_round,
            "rounds": args.rounds, "servers": kinds, "disk": args.disk,
            "plain_MBps": statistics.median(rates["plain"]),
            "events_MBps": statistics.median(rates["events"]),
            "rounds_MBps": rates,
            "server_median_MBps": [statistics.median(r) for r in per_server],
            "subscriber_batches": counts["batches"],
        }
        result["events_vs_plain"] = result["events_MBps"] / result["plain_MBps"]
        print(json.dumps(result, indent=2))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        result["control"] = args.control
        if counts["batches"] == 0 and not (args.control or args.no_subscriber):
            sys.exit("the subscriber received no event batch: the events path did not run")
    finally:
        stop.set()
        for _, p, _ in servers:
            p.terminate()
            p.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
