"""Time to first token on a real vLLM engine (CPU): a kvtier hit against
recomputing the prompt, in the same run.

    scripts/engine-venv   # prints the engines' python
    ENGINES_PY=$(scripts/engine-venv | tail -n 1)
    $ENGINES_PY python/benchmarks/vllm_ttft.py [--tokens 4096] [--repeat 3] [--json out.json]

Writes a random-weight Llama locally (no downloads: 8 layers, hidden 768,
4 KV heads of 64, float32, about 50 M parameters, so a 4k-token prefill
takes seconds on a small CPU), starts `kvtier serve` (target/release/kvtier,
or --url for one already running) and one vLLM engine with the kvtier
connector (scheduler and worker in separate processes). For each repeat, a
fresh random prompt is run twice with max_tokens=1:

- recompute: vLLM and kvtier have never seen it (the run saves it);
- kvtier hit: vLLM's own prefix cache is reset first, so every full block
  of the prompt comes from kvtier through shared memory.

TTFT is the wall time of `LLM.generate` for the one token (the same
overheads on both sides). Both runs must produce the same token. Reports
medians over the repeats, the ratio, and the bytes kvtier served.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]


def write_model(path: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192,
        torch_dtype="float32", tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def start_server(directory: pathlib.Path) -> tuple[subprocess.Popen, str, str]:
    binary = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    process = subprocess.Popen(
        [binary, "serve", "--data-dir", str(directory), "--memory", "2GiB", "--disk", "8GiB",
         "--listen", "off", "--admin", "127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "RUST_LOG": "warn"},
    )
    line = process.stdout.readline()
    if not line.startswith("kvtier serving"):
        raise SystemExit(f"kvtier serve did not start: {line}")
    admin = next(p for p in line.replace(",", " ").split() if p.startswith("http://"))
    return process, f"unix://{directory / 'kvtier.sock'}", admin


def served_bytes(admin: str | None) -> int:
    if admin is None:
        return 0
    with urllib.request.urlopen(admin + "/stats", timeout=10) as r:
        return json.load(r)["server"]["ops"]["batch_get_shm_segments"]["bytes_out"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--url", help="a running kvtier server (default: start one)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
    write_model(scratch / "model")
    server, admin = None, None
    url = args.url
    if url is None:
        server, url, admin = start_server(scratch / "kvtier-data")

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(
        model=str(scratch / "model"), skip_tokenizer_init=True, dtype="float32", block_size=32,
        max_model_len=args.tokens + 64, max_num_batched_tokens=args.tokens + 64, enforce_eager=True,
        gpu_memory_utilization=0.1, seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvtier_url": url, "staging_size": 512 << 20},
        ),
    )
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)

    def ttft(prompt: list[int]) -> tuple[float, list[int]]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)[0]
        return time.perf_counter() - start, list(out.outputs[0].token_ids)

    rng = random.Random(7)
    ttft([rng.randrange(1, 4096) for _ in range(256)])  # warm-up
    recompute, hit, moved = [], [], []
    for r in range(args.repeat):
        prompt = [rng.randrange(1, 4096) for _ in range(args.tokens)]
        cold_s, cold_tokens = ttft(prompt)
        assert llm.reset_prefix_cache()
        before = served_bytes(admin)
        hit_s, hit_tokens = ttft(prompt)
        moved.append(served_bytes(admin) - before)
        assert hit_tokens == cold_tokens, (hit_tokens, cold_tokens)
        assert llm.reset_prefix_cache()
        recompute.append(cold_s)
        hit.append(hit_s)
        print(f"run {r}: recompute {cold_s:.3f} s, kvtier hit {hit_s:.3f} s, {moved[-1] / 2**20:.1f} MiB from kvtier",
              flush=True)

    result = {
        "prompt_tokens": args.tokens,
        "repeats": args.repeat,
        "recompute_ttft_s": statistics.median(recompute),
        "kvtier_hit_ttft_s": statistics.median(hit),
        "ratio": statistics.median(recompute) / statistics.median(hit),
        "bytes_from_kvtier": statistics.median(moved),
        "runs": {"recompute_s": recompute, "kvtier_hit_s": hit, "bytes": moved},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    del llm
    if server is not None:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
