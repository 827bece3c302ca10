"""LMCache's own L2 benchmark (`lmcache bench l2`: store, lookup and load
of batches of objects through an L2 adapter) with kvtier's native plugin
(and, as `kvtier_cross_memory`, against a server with `map_pool = false`)
beside LMCache's `fs`, `fs_native`, `raw_block` and `mooncake_store`
adapters, on this machine, in one run, with the memcpy ceiling measured
before each repeat; then kvtier's plugin and fs_native's client paired in
one process, round by round (`lmcache_paired.py`, `--paired-rounds`). Run
by `scripts/lmcache-l2-bench`.

Every adapter gets the same objects (``--num-keys`` per submit of
``--data-size-kb`` each, ``--rounds`` rounds, every loaded byte verified by
LMCache's bench), its own fresh directory, file or service, and runs once
per repeat; the repeats interleave the adapters (every other repeat in
reverse order) and the table shows medians. kvtier runs as `kvtier serve`
over its Unix socket; `fs` and `fs_native` write files under a scratch
directory on the same disk, `raw_block` a preallocated file with
O_DIRECT, `mooncake_store` a local `mooncake_master` over TCP. An adapter
that cannot run is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
ADAPTERS = ("kvtier", "kvtier_cross_memory", "fs", "fs_native", "raw_block", "mooncake_store")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} never listened on {port}")


def kvtier_binary() -> str:
    return os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")


def bench_env(peers: str) -> dict:
    """The environment LMCache's processes run in: its wheel and this
    repository's package importable, and OMP_WAIT_POLICY=PASSIVE (the bench
    zeroes its load buffers with torch before each load round, and torch's
    OpenMP threads then spin for a while on the cores the load's copies
    need, whichever process makes them; measured: fs_native loads 9.8 ->
    12.5 GB/s with it, kvtier 5.6 -> 8.3)."""
    return {**os.environ, "PYTHONPATH": peers + os.pathsep + str(REPO / "python"), "LMCACHE_DISABLE_BANNER": "1",
            "OMP_WAIT_POLICY": "PASSIVE"}


def adapter_spec(name: str, work: pathlib.Path, peers: str, args, services: list) -> dict:
    """The adapter's JSON, starting what it needs."""
    if name in ("kvtier", "kvtier_cross_memory"):
        binary = kvtier_binary()
        data = work / "kvtier"
        # kvtier_cross_memory: the same server without pool mapping, so
        # loads go by cross-memory transfers (the server copies).
        config = work / "serve.toml"
        config.write_text("map_pool = false\n" if name == "kvtier_cross_memory" else "")
        server = subprocess.Popen([binary, "serve", "--data-dir", str(data), "--memory", "2GiB", "--disk", "8GiB",
                                   "--listen", "off", "--admin", "off", "--config", str(config)],
                                  stdout=subprocess.PIPE, text=True)
        line = server.stdout.readline()
        if not line.startswith("kvtier serving"):
            raise RuntimeError(f"kvtier serve did not start: {line}")
        services.append(lambda: (server.send_signal(signal.SIGTERM), server.wait(timeout=60)))
        # LMCache's bench names a made-up model ("bench-model"): no weights
        # to fingerprint, so it is pinned (a real deployment's model names
        # lead to its weights, or are pinned the same way).
        return {"type": "native_plugin", "module_path": "kvtier.integrations.lmcache",
                "class_name": "KvtierL2Connector",
                "adapter_params": {"kvtier_url": f"unix://{data / 'kvtier.sock'}",
                                   "model_fingerprints": {"bench-model": "lmcache-bench"}}}
    if name == "fs":
        return {"type": "fs", "base_path": str(work / "fs")}
    if name == "fs_native":
        return {"type": "fs_native", "base_path": str(work / "fs_native")}
    if name == "raw_block":
        path = work / "raw_block.img"
        total = args.rounds_total_bytes * 2 + (512 << 20)
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, total)
        slot = (args.data_size_kb * 1024 + 4096 + 4095) // 4096 * 4096
        return {"type": "raw_block", "device_path": str(path), "slot_bytes": slot, "use_odirect": True,
                "io_engine": "io_uring"}
    if name == "mooncake_store":
        master = pathlib.Path(peers) / "mooncake" / "mooncake_master"
        rpc, http = free_port(), free_port()
        libs = [str(pathlib.Path(peers) / "mooncake_transfer_engine_non_cuda.libs"), str(master.parent)]
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])}
        log = open(work / "mooncake_master.log", "w")
        process = subprocess.Popen([str(master), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                    "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}"],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
        services.append(lambda: (process.terminate(), process.wait(timeout=60), log.close()))
        wait_port(rpc, process, "mooncake_master")
        return {"type": "mooncake_store", "local_hostname": "127.0.0.1",
                "metadata_server": f"http://127.0.0.1:{http}/metadata", "master_server_address": f"127.0.0.1:{rpc}",
                "protocol": "tcp", "device_name": "", "global_segment_size": 2 << 30,
                "local_buffer_size": 512 << 20}
    raise ValueError(name)


def run_one(name: str, scratch: pathlib.Path, peers: str, args, repeat: int) -> dict:
    work = scratch / f"{name}-{repeat}"
    work.mkdir(parents=True)
    services: list = []
    try:
        spec = adapter_spec(name, work, peers, args, services)
        out = work / "result.json"
        env = bench_env(peers)
        libs = [str(pathlib.Path(peers) / "mooncake_transfer_engine_non_cuda.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])
        command = [sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", json.dumps(spec),
                   "--num-keys", str(args.num_keys), "--data-size-kb", str(args.data_size_kb),
                   "--rounds", str(args.rounds), "--warmup-rounds", "1", "--in-flight", str(args.in_flight),
                   "--lookup-max-hit-rate", "1.0", "--no-skip-verify", "--format", "json", "--output", str(out), "-q"]
        if name == "raw_block":
            command += ["--l1-align-bytes", "4096"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if run.returncode != 0 or not out.exists():
            lines = [ln for ln in (run.stdout + run.stderr).splitlines()
                     if ("Error" in ln or "Failed" in ln) and " INFO" not in ln]
            raise RuntimeError(f"exited {run.returncode}: " + (lines[-1] if lines else run.stderr[-800:]))
        return json.loads(out.read_text())
    finally:
        for stop in services:
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - reported, the result stands
                print(f"{name}: stopping a service: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


def run_paired(scratch: pathlib.Path, args) -> dict:
    """kvtier's plugin and fs_native's client in one process, round by
    round (lmcache_paired.py says why)."""
    work = scratch / "paired"
    work.mkdir()
    out = work / "paired.json"
    try:
        subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("lmcache_paired.py")), kvtier_binary(),
                        str(work), str(args.num_keys), str(args.data_size_kb), str(args.paired_store_rounds),
                        str(args.paired_rounds), str(out)], env=bench_env(args.peers), check=True, timeout=900,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def memcpy_ceiling(args) -> float:
    """What a load can reach on this machine now: MB/s of one round's bytes
    copied from memory it has not just touched into zeroed buffers, on as
    many threads as there are cores (torch's copy), median of 20 rounds.
    Both kvtier's and fs_native's loads are such a copy; neither can pass
    it."""
    import torch

    size = args.num_keys * args.data_size_kb * 1024
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    sources = [torch.ones(size, dtype=torch.uint8) for _ in range(8)]
    dst = torch.empty(size, dtype=torch.uint8)
    rates = []
    for r in range(20):
        dst.zero_()
        t0 = time.perf_counter()
        dst.copy_(sources[r % len(sources)])
        rates.append(size / (time.perf_counter() - t0) / 1e6)
    return statistics.median(rates)


def figures(result: dict) -> dict:
    """Per operation: MB/s (store, load), p50 round ms, keys found."""
    ops = {}
    for op in (result.get("metrics") or {}).values():
        if isinstance(op, dict) and "operation" in op:
            ops[op["operation"].lower()] = op
    if not ops:
        raise RuntimeError(f"no operations in lmcache's output: {str(result)[:500]}")
    return {
        "store_mb_s": ops["store"]["throughput_avg_mbps"],
        "load_mb_s": ops["load"]["throughput_avg_mbps"],
        "store_p50_ms": ops["store"]["duration_p50_ms"],
        "lookup_p50_ms": ops["lookup"]["duration_p50_ms"],
        "load_p50_ms": ops["load"]["duration_p50_ms"],
        "lookup_found": ops["lookup"]["total_success"],
        "loaded": ops["load"]["total_success"],
        "keys": ops["load"]["total_keys"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", required=True, help="scripts/peer-stores' directory")
    parser.add_argument("--adapters", default=",".join(ADAPTERS))
    parser.add_argument("--num-keys", type=int, default=32)
    parser.add_argument("--data-size-kb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--paired-rounds", type=int, default=200,
                        help="load rounds of each of kvtier and fs_native paired in one process (0: none)")
    parser.add_argument("--paired-store-rounds", type=int, default=24,
                        help="store rounds of each, paired (fs_native's files stay within the dirty-page limits)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.rounds_total_bytes = (args.rounds + 1) * args.in_flight * args.num_keys * args.data_size_kb * 1024
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-lmcache-l2-", dir=os.environ.get("KVTIER_BENCH_DIR")))
    runs: dict[str, list[dict]] = {}
    errors: dict[str, str] = {}
    ceilings: list[float] = []
    paired = None
    named = args.adapters.split(",")
    try:
        for repeat in range(args.repeat):
            ceilings.append(memcpy_ceiling(args))
            print(f"run {repeat} memcpy ceiling: {ceilings[-1]:.0f} MB/s", flush=True)
            # Every other repeat in reverse, so no adapter always runs first
            # after the ceiling's copies (or last, after the others' files).
            for name in named if repeat % 2 == 0 else reversed(named):
                if name in errors:
                    continue
                try:
                    f = figures(run_one(name, scratch, args.peers, args, repeat))
                except Exception as e:  # noqa: BLE001 - an adapter that cannot run is reported
                    errors[name] = str(e)
                    print(f"{name}: did not run: {e}", flush=True)
                    continue
                runs.setdefault(name, []).append(f)
                print(f"run {repeat} {name}: store {f['store_mb_s']:.0f} MB/s, load {f['load_mb_s']:.0f} MB/s, "
                      f"lookup p50 {f['lookup_p50_ms']:.2f} ms, loaded {f['loaded']}/{f['keys']}", flush=True)
        if args.paired_rounds > 0 and "kvtier" in named and "fs_native" in named:
            paired = run_paired(scratch, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"runs": rs}
             for name, rs in runs.items()}
    report = {"num_keys": args.num_keys, "data_size_kb": args.data_size_kb, "rounds": args.rounds,
              "in_flight": args.in_flight, "repeat": args.repeat, "adapters": table, "not_run": errors,
              "memcpy_ceiling_mb_s": statistics.median(ceilings) if ceilings else None,
              "memcpy_ceiling_runs": ceilings, "paired": paired}
    print("| adapter | store MB/s | load MB/s | store round p50 (ms) | lookup round p50 (ms) | load round p50 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in table.items():
        print(f"| {name} | {t['store_mb_s']:.0f} | {t['load_mb_s']:.0f} | {t['store_p50_ms']:.1f} | "
              f"{t['lookup_p50_ms']:.2f} | {t['load_p50_ms']:.1f} |")
    if ceilings:
        print(f"| memcpy ceiling (a round's bytes, every core) | | {statistics.median(ceilings):.0f} | | | |")
    if paired:
        print(f"\nPaired in one process, round by round ({args.num_keys} x {args.data_size_kb} KiB per round, p50):")
        print("| operation | kvtier MB/s | fs_native MB/s | kvtier / fs_native |")
        print("|---|---:|---:|---:|")
        for op in ("store", "load"):
            print(f"| {op} | {paired[op]['kvtier']['mb_s']:.0f} | {paired[op]['fs_native']['mb_s']:.0f} | "
                  f"{paired[op]['kvtier_to_fs_native']:.2f} |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    incomplete = [n for n, t in table.items() if any(r["loaded"] != r["keys"] for r in t["runs"])]
    if incomplete:
        raise SystemExit(f"adapters that did not load every key back: {incomplete}")


if __name__ == "__main__":
    sys.exit(main())
