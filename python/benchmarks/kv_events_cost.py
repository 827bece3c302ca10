"""What publishing KV events costs batch puts: two `kvtier serve`
processes, identical but for `--kv-events` (the second with a pyzmq
subscriber draining every batch, as a router would), fed the same batch
puts in alternating rounds from this one process.

    python python/benchmarks/kv_events_cost.py [--rounds 11] [--json out.json] [--smoke]

Each round puts `--batch` values of `--value` bytes (new keys) through
kvtier shared memory, `--per-round` times; a round's rate is its bytes over
its time. Reports the median rate of each server and their ratio. Memory
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
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--value", type=int, default=64 << 10)
    ap.add_argument("--memory", default="4GiB")
    ap.add_argument("--disk", default="0")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="3 small rounds; checks that events flowed, times nothing")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.per_round, args.memory = 3, 2, "512MiB"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-events-bench-"))
    plain, plain_url, _ = serve(tmp / "plain", args.memory, args.disk, events=False)
    evented, evented_url, pub = serve(tmp / "events", args.memory, args.disk, events=True)
    stop, counts = threading.Event(), {"batches": 0}
    subscriber = threading.Thread(target=drain, args=(pub, stop, counts), daemon=True)
    subscriber.start()
    try:
        size = args.batch * args.value
        clients = {name: Client(url, namespace="bench/kv-events", shm_size=size)
                   for name, url in (("plain", plain_url), ("events", evented_url))}
        staging = {name: c.alloc_buffer(size) for name, c in clients.items()}
        for name, buf in staging.items():
            memoryview(buf)[:] = os.urandom(size)
        rates = {"plain": [], "events": []}
        for r in range(args.rounds):
            for name in ("plain", "events") if r % 2 == 0 else ("events", "plain"):
                client, buf = clients[name], staging[name]
                ptrs = [[buf.ptr + i * args.value] for i in range(args.batch)]
                sizes = [[args.value]] * args.batch
                started = time.perf_counter()
                for j in range(args.per_round):
                    keys = [f"r{r}-{j}-{i}" for i in range(args.batch)]
                    codes = client.batch_put_from_multi_buffers(keys, ptrs, sizes)
                    assert all(c == 0 for c in codes), codes[:4]
                elapsed = time.perf_counter() - started
                rates[name].append(size * args.per_round / elapsed / 1e6)
        time.sleep(0.5)
        result = {
            "value_bytes": args.value, "batch": args.batch, "puts_per_round": args.batch * args.per_round,
            "rounds": args.rounds, "disk": args.disk,
            "plain_MBps": statistics.median(rates["plain"]),
            "events_MBps": statistics.median(rates["events"]),
            "rounds_MBps": rates,
            "subscriber_batches": counts["batches"],
        }
        result["events_vs_plain"] = result["events_MBps"] / result["plain_MBps"]
        print(json.dumps(result, indent=2))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if counts["batches"] == 0:
            sys.exit("the subscriber received no event batch: the events path did not run")
    finally:
        stop.set()
        for p in (plain, evented):
            p.terminate()
            p.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
