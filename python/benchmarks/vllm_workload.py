"""A multi-turn workload on a real vLLM engine (CPU): time to first token
and requests per second with no cache, with vLLM's own prefix cache, with
kvtier behind it (memory-tier and disk-tier hits), and with every peer
connector that runs on this machine, in one run.

    ENGINES_PY=$(scripts/engine-venv | tail -n 1)
    $ENGINES_PY python/benchmarks/vllm_workload.py [--json out.json]
    $ENGINES_PY python/benchmarks/vllm_workload.py --smoke   # CI: small, untimed checks
    PEERS=$(scripts/peer-stores | tail -n 1)                # Mooncake Store, LMCache
    $ENGINES_PY python/benchmarks/vllm_workload.py --peers "$PEERS"

The workload: ``--users`` conversations share one system prompt; each turn
appends the user's message, and the next turn appends the assistant's reply
and a new message, so every request's prompt is the user's whole history.
Turns are served round-robin over the users, one request at a time (TTFT is
then the request's own prefill or load, never a queue). The replies in the
history are fixed tokens (the same in every mode, so every mode serves the
same prompts); each request still generates ``--generate`` tokens. vLLM's
own KV cache holds ``--kv-fraction`` of the working set (every user's
history), so its prefix cache alone loses most of it between a user's
turns; an external cache keeps all of it.

Modes, each in a fresh engine process (same model, prompts and settings):

- ``recompute``: no prefix caching, no connector: every prompt computed.
- ``local``: vLLM's prefix cache only.
- ``kvtier-memory``: vLLM's prefix cache and ``KvtierConnector`` (its
  defaults: asynchronous loads, slow hits skipped) against a fresh
  ``kvtier serve`` with room for everything in memory.
- ``kvtier-disk``: the same, but the server is restarted before every round
  of turns: its memory tier starts empty and hits come from its disk tier.
- ``kvtier-sync``: as ``kvtier-memory`` with ``"async_loads": false`` (loads
  inside the step, waited for per layer).
- ``mooncake``: vLLM's ``MooncakeStoreConnector`` with a local
  ``mooncake_master`` (``mooncake-transfer-engine-non-cuda`` wheel, TCP),
  when ``--peers`` holds it.
- ``lmcache``: vLLM's ``LMCacheMPConnector`` with LMCache's MP server
  (``lmcache`` wheel), when ``--peers`` holds it.

A peer that fails to start is reported with its exact error, never silently
left out. Reported per mode: TTFT p50/p95 (vLLM's own first-token latency),
requests per second (requests over the time spent in ``generate``), the
share of prompt tokens served from a cache (local or external), how many
hits were slower than recomputing the same request (its TTFT against the
``recompute`` mode's), and whether the first generated token agrees with
``recompute`` (it must, but for float rounding between different batch
shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 32
MODES = ("recompute", "local", "kvtier-memory", "kvtier-disk", "kvtier-sync", "mooncake", "lmcache")


# The workload.


def conversations(args) -> list[tuple[int, int, list[int]]]:
    """(user, turn, prompt) in serving order: round-robin over users."""
    rng = random.Random(args.seed)
    vocab = args.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    histories = [list(system) for _ in range(args.users)]
    requests = []
    for turn in range(args.turns):
        for user in range(args.users):
            if turn:
                histories[user] += tokens(args.reply_tokens)  # the previous reply
            histories[user] += tokens(args.user_tokens)
            requests.append((user, turn, list(histories[user])))
    return requests


def kv_blocks(args, requests) -> tuple[int, int]:
    """vLLM's KV cache size in blocks (a fraction of the working set, but
    room for the longest request) and the working set."""
    unique = set()
    for _, _, prompt in requests:
        for end in range(BLOCK, len(prompt) + 1, BLOCK):
            unique.add(tuple(prompt[:end][-BLOCK:]) + (end,))
    working = len(unique)
    longest = max(len(p) for _, _, p in requests) + args.generate
    return max(int(working * args.kv_fraction), longest // BLOCK + 4), working


def write_model(path: pathlib.Path, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
        max_position_embeddings=8192, torch_dtype="float32", tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Sharper than the default init: greedy tokens follow the KV closely
        # (so wrong KV would show in the agreement figure).
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(path)


# The services each mode needs.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kvtier:
    def __init__(self, directory: pathlib.Path, memory: str):
        self.directory, self.memory = directory, memory
        self.process = None
        self.start()

    @property
    def url(self) -> str:
        return f"unix://{self.directory / 'kvtier.sock'}"

    def start(self) -> None:
        binary = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
        self.process = subprocess.Popen(
            [binary, "serve", "--data-dir", str(self.directory), "--memory", self.memory, "--disk", "8GiB",
             "--listen", "off", "--admin", "127.0.0.1:0"],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"},
        )
        line = self.process.stdout.readline()
        if not line.startswith("kvtier serving"):
            raise RuntimeError(f"kvtier serve did not start: {line}")
        self.admin = next(p for p in line.replace(",", " ").split() if p.startswith("http://"))

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        if self.process.wait(timeout=120) != 0:
            raise RuntimeError("kvtier serve did not stop cleanly")

    def stats(self) -> dict:
        with urllib.request.urlopen(self.admin + "/stats", timeout=10) as r:
            return json.load(r)


class Mooncake:
    """A local mooncake_master with its HTTP metadata server."""

    def __init__(self, peers: str, directory: pathlib.Path):
        master = pathlib.Path(peers) / "mooncake" / "mooncake_master"
        if not master.exists():
            raise RuntimeError(f"no mooncake_master in {peers} (scripts/peer-stores installs it)")
        self.rpc, self.http = free_port(), free_port()
        libs = [str(pathlib.Path(peers) / "mooncake_transfer_engine_non_cuda.libs"), str(master.parent)]
        env = {**os.environ, "LD_LIBRARY_PATH": ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])}
        self.log = open(directory / "mooncake_master.log", "w")
        self.process = subprocess.Popen(
            [str(master), f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={self.http}"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        wait_port(self.rpc, self.process, directory / "mooncake_master.log")
        self.config = directory / "mooncake.json"
        self.config.write_text(json.dumps({
            "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
            "master_server_address": f"127.0.0.1:{self.rpc}",
            "protocol": "tcp", "device_name": "", "mode": "embedded",
            "global_segment_size": "2GB", "local_buffer_size": "512MB",
        }))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


class LMCacheServer:
    """LMCache's MP server (the L1 in DRAM)."""

    def __init__(self, peers: str, directory: pathlib.Path):
        self.port = free_port()
        self.log = open(directory / "lmcache_server.log", "w")
        env = {**os.environ, "PYTHONPATH": peers, "LMCACHE_DISABLE_BANNER": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--l1-size-gb", "2", "--eviction-policy", "LRU", "--chunk-size", "256"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        wait_port(self.port, self.process, directory / "lmcache_server.log", timeout=180)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def wait_port(port: int, process: subprocess.Popen, log: pathlib.Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{log.name} exited {process.returncode}: " + last_error(log.read_text()))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s: " + last_error(log.read_text()))


def last_error(text: str) -> str:
    """The line that says what failed (a traceback's last line), else the tail."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [i for i, ln in enumerate(lines) if "Error" in ln.split(":")[0] or ln.startswith(("E0", "F0"))]
    if not errors:
        return "\n".join(lines[-5:])[-1500:]
    # The error and the frame that raised it.
    at = errors[-1]
    frame = next((lines[i] for i in range(at - 1, max(at - 6, -1), -1) if lines[i].lstrip().startswith("File ")), "")
    return (lines[at] + (f" ({frame.strip()})" if frame else ""))[-1500:]


# One mode in one engine process.


def engine_main(spec: dict) -> None:
    """Runs in a fresh process: one engine, the whole workload, one JSON
    line. ``restart`` lines on stdin/stdout let the driver restart the
    kvtier server between rounds."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if spec["connector"]:
        transfer = KVTransferConfig(kv_role="kv_both", kv_load_failure_policy="recompute", **spec["connector"])
    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", block_size=BLOCK,
        max_model_len=spec["max_len"], max_num_batched_tokens=spec["max_len"], max_num_seqs=4,
        enforce_eager=True, gpu_memory_utilization=0.1, seed=0, num_gpu_blocks_override=spec["kv_blocks"],
        enable_prefix_caching=spec["prefix_caching"], kv_transfer_config=transfer, disable_log_stats=False,
    )
    params = SamplingParams(max_tokens=spec["generate"], temperature=0, ignore_eos=True, detokenize=False)
    rng = random.Random(99)
    llm.generate([{"prompt_token_ids": [rng.randrange(1, spec["vocab"]) for _ in range(256)]}], params,
                 use_tqdm=False)  # warm-up
    results, turn_seen = [], -1
    for user, turn, prompt in spec["requests"]:
        if spec["restart_each_turn"] and turn != turn_seen and turn > 0:
            print("RESTART", flush=True)
            assert sys.stdin.readline().strip() == "OK"
        turn_seen = turn
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or wall
        results.append({"user": user, "turn": turn, "prompt": len(prompt), "cached": out.num_cached_tokens or 0,
                        "ttft": ttft, "wall": wall, "first": out.outputs[0].token_ids[0]})
    stats = {}
    try:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        stats = connector.stats() if hasattr(connector, "stats") else {}
    except AttributeError:
        pass
    print("RESULT " + json.dumps({"requests": results, "connector": stats}), flush=True)


def run_mode(mode: str, args, scratch: pathlib.Path, model: str, requests, blocks: int) -> dict:
    spec = {
        "model": model, "max_len": max(len(p) for _, _, p in requests) + args.generate + BLOCK,
        "kv_blocks": blocks, "generate": args.generate, "vocab": args.vocab, "requests": requests,
        "prefix_caching": mode != "recompute", "connector": None, "restart_each_turn": False,
    }
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    services = []
    kvtier = None
    try:
        if mode.startswith("kvtier"):
            # Every run starts from an empty store (a repeat must not hit
            # what the previous one left on disk).
            shutil.rmtree(scratch / f"kvtier-{mode}", ignore_errors=True)
            kvtier = Kvtier(scratch / f"kvtier-{mode}", "4GiB")
            services.append(kvtier)
            extra = {"kvtier_url": kvtier.url}
            if mode == "kvtier-sync":
                extra["async_loads"] = False
            spec["connector"] = {"kv_connector": "KvtierConnector", "kv_connector_module_path":
                                 "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
            spec["restart_each_turn"] = mode == "kvtier-disk"
        elif mode == "mooncake":
            if not args.peers:
                raise RuntimeError("not installed: pass --peers (scripts/peer-stores installs the "
                                   "mooncake-transfer-engine-non-cuda wheel)")
            mooncake = Mooncake(args.peers, scratch)
            services.append(mooncake)
            env["MOONCAKE_CONFIG_PATH"] = str(mooncake.config)
            env["PYTHONPATH"] = args.peers
            libs = [str(pathlib.Path(args.peers) / "mooncake_transfer_engine_non_cuda.libs")]
            env["LD_LIBRARY_PATH"] = ":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")])
            spec["connector"] = {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {}}
        elif mode == "lmcache":
            if not args.peers:
                raise RuntimeError("not installed: pass --peers (scripts/peer-stores installs the lmcache wheel)")
            server = LMCacheServer(args.peers, scratch)
            services.append(server)
            env["PYTHONPATH"] = args.peers
            spec["connector"] = {"kv_connector": "LMCacheMPConnector", "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port}}
        spec_path = scratch / f"spec-{mode}.json"
        spec_path.write_text(json.dumps(spec))
        log_path = scratch / f"engine-{mode}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen([sys.executable, __file__, "--engine", str(spec_path)], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            result = None
            for line in process.stdout:
                if line.startswith("RESTART"):
                    # Cycle the memory tier: a clean stop flushes, the start
                    # finds everything on disk and nothing in memory.
                    kvtier.stop()
                    kvtier.start()
                    process.stdin.write("OK\n")
                    process.stdin.flush()
                elif line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
            process.wait(timeout=600)
        if result is None:
            raise RuntimeError(f"engine exited {process.returncode}: " + last_error(log_path.read_text()))
        if kvtier is not None:
            store = kvtier.stats()["store"]
            result["kvtier"] = {k: store.get(k) for k in ("memory_entries", "memory_hits", "disk_hits", "checksum_failures")}
        return result
    finally:
        for service in services:
            try:
                service.stop()
            except Exception:  # noqa: BLE001 - the result stands; a service that will not stop is logged
                traceback.print_exc()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(mode: str, result: dict, baseline: dict | None) -> dict:
    reqs = result["requests"]
    ttft = [r["ttft"] for r in reqs]
    summary = {
        "requests": len(reqs),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": percentile(ttft, 0.95),
        "requests_per_s": len(reqs) / sum(r["wall"] for r in reqs),
        "cached_token_share": sum(r["cached"] for r in reqs) / sum(r["prompt"] for r in reqs),
        "connector": result.get("connector") or {},
    }
    if "kvtier" in result:
        summary["kvtier"] = result["kvtier"]
    if baseline is not None:
        base = baseline["requests"]
        hits = [(r, b) for r, b in zip(reqs, base) if r["cached"] > 0]
        summary["hits_slower_than_recompute"] = sum(1 for r, b in hits if r["ttft"] > b["ttft"])
        summary["requests_with_hits"] = len(hits)
        summary["first_token_agreement"] = sum(r["first"] == b["first"] for r, b in zip(reqs, base)) / len(reqs)
        summary["ttft_p50_vs_recompute"] = statistics.median(b["ttft"] for b in base) / summary["ttft_p50_s"]
    return summary


def merge(summaries: list[dict]) -> dict:
    """The median of every figure over the repeats (each repeat's modes ran
    back to back, so ratios within a repeat are the ones to trust), with
    the per-run TTFT p50 and requests per second kept."""
    merged = dict(summaries[-1])
    for key, value in summaries[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(s[key] for s in summaries)
    merged["runs"] = len(summaries)
    merged["ttft_p50_s_runs"] = [s["ttft_p50_s"] for s in summaries]
    merged["requests_per_s_runs"] = [s["requests_per_s"] for s in summaries]
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=256)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--generate", type=int, default=4, help="tokens each request generates")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="vLLM's own KV cache, of the working set")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeat", type=int, default=1, help="runs of every mode (medians are reported)")
    parser.add_argument("--peers", help="a directory holding the peer wheels (scripts/peer-stores)")
    parser.add_argument("--smoke", action="store_true", help="a small run with checks (CI)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine_main(json.loads(pathlib.Path(args.engine).read_text()))
    if args.smoke:
        args.users, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens = 3, 2, 256, 64, 32
        args.layers, args.hidden, args.vocab = 2, 256, 512
        if args.modes == ",".join(MODES):
            args.modes = "recompute,local,kvtier-memory,kvtier-disk"

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-workload-"))
    try:
        write_model(scratch / "model", args)
        requests = conversations(args)
        blocks, working = kv_blocks(args, requests)
        print(f"{len(requests)} requests, working set {working} blocks, vLLM's cache {blocks} blocks", flush=True)
        report = {"workload": {k: getattr(args, k) for k in (
            "users", "turns", "system_tokens", "user_tokens", "reply_tokens", "generate", "kv_fraction",
            "layers", "hidden", "repeat")}, "working_set_blocks": working, "vllm_kv_blocks": blocks, "modes": {},
            "not_run": {}}
        runs: dict[str, list[dict]] = {}
        modes = args.modes.split(",")
        for repeat in range(args.repeat):
            raw = {}
            for mode in modes:
                if mode in report["not_run"]:
                    continue
                started = time.monotonic()
                try:
                    raw[mode] = run_mode(mode, args, scratch, str(scratch / "model"), requests, blocks)
                except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, with its error
                    report["not_run"][mode] = str(e)
                    print(f"{mode}: did not run: {e}", flush=True)
                    continue
                summary = summarize(mode, raw[mode], raw.get("recompute"))
                runs.setdefault(mode, []).append(summary)
                print(f"run {repeat} {mode}: TTFT p50 {summary['ttft_p50_s'] * 1000:.1f} ms, p95 {summary['ttft_p95_s'] * 1000:.1f} ms, "
                  f"{summary['requests_per_s']:.2f} req/s, cached {summary['cached_token_share']:.0%}, "
                  f"slower hits {summary.get('hits_slower_than_recompute', '-')}, "
                  f"agreement {summary.get('first_token_agreement', '-')} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
        for mode, summaries in runs.items():
            report["modes"][mode] = merge(summaries)
        print(json.dumps(report, indent=2))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.smoke:
            check_smoke(report)
    finally:
        if os.environ.get("KVTIER_KEEP_SCRATCH"):
            print(f"scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def check_smoke(report: dict) -> None:
    """Untimed: every kvtier mode ran and served what vLLM's cache lost."""
    modes = report["modes"]
    missing = [m for m in ("recompute", "local", "kvtier-memory", "kvtier-disk") if m not in modes]
    assert not missing, f"modes did not run: {missing}: {report['not_run']}"
    assert modes["recompute"]["cached_token_share"] == 0
    for mode in ("kvtier-memory", "kvtier-disk"):
        m = modes[mode]
        assert m["cached_token_share"] > modes["local"]["cached_token_share"], (mode, m, modes["local"])
        assert m["first_token_agreement"] >= 0.9, (mode, m)
        assert m["kvtier"]["checksum_failures"] == 0, m
    assert modes["kvtier-disk"]["kvtier"]["disk_hits"] > 0, modes["kvtier-disk"]
    print("smoke checks passed")


if __name__ == "__main__":
    sys.exit(main())
