"""kvtier with vLLM on a CUDA GPU, end to end with a real model: the
connector (asynchronous loads through CUDA-registered shared memory) and
the secondary tier behind vLLM's own CPU offloading (TieringOffloadingSpec,
whose GPU half needs CUDA). Run by ``scripts/vllm-gpu-check`` (one
command); needs a GPU, the official CUDA ``vllm`` wheel and a built
``kvtier``. Writes a random-weight Llama locally (no downloads).

Each check runs engines as subprocesses (a fresh process is a fresh GPU
cache and a fresh CPU primary tier) and compares greedy outputs:

1. connector: engine A computes a prompt (saving its blocks), resets its
   own prefix cache and runs it again: the prompt's blocks come from kvtier
   (``num_cached_tokens``) and the output is identical to the computed one;
   a second engine process hits the same blocks with the same output.
2. tier: engine A with OffloadingConnector + kvtier as secondary tier
   computes the prompt (stores cascade GPU -> CPU primary -> kvtier);
   engine B, a fresh process with an empty GPU cache and an empty primary
   tier, runs it: the blocks are promoted from kvtier into its primary and
   loaded to the GPU, and its output is identical to A's.

Prints one JSON summary; exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [(i * 37 + 11) % 4000 + 1 for i in range(1000)]


def write_model(path: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
        torch_dtype="float16", tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    model.half().save_pretrained(path)


def engine(spec: dict) -> None:
    """One engine process: run the steps, print one RESULT per run."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float16", block_size=16,
              max_model_len=2048, gpu_memory_utilization=0.3, seed=0, enforce_eager=True,
              kv_transfer_config=KVTransferConfig(**spec["transfer"]))
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3, detokenize=False)
    for step in spec["steps"]:
        if step == "reset":
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
            continue
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        completion = out.outputs[0]
        print("RESULT " + json.dumps({
            "cached": out.num_cached_tokens or 0, "tokens": list(completion.token_ids),
            "logprobs": [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in completion.logprobs],
        }), flush=True)


def run_engine(model: str, transfer: dict, steps: list[str], scratch: pathlib.Path, name: str) -> list[dict]:
    spec = scratch / f"{name}.json"
    spec.write_text(json.dumps({"model": model, "transfer": transfer, "steps": steps}))
    log = scratch / f"{name}.log"
    with open(log, "w") as err:
        out = subprocess.run([sys.executable, __file__, "--engine", str(spec)], stdout=subprocess.PIPE,
                             stderr=err, text=True, timeout=1200)
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or len(results) != sum(1 for s in steps if s == "run"):
        raise SystemExit(f"{name}: engine exited {out.returncode}; log {log}:\n" + log.read_text()[-4000:])
    return results


def same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--engine":
        return engine(json.loads(pathlib.Path(sys.argv[2]).read_text()))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device: this check needs a GPU (it never falls back to the CPU)")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-gpu-"))
    model = scratch / "model"
    write_model(model)
    binary = os.environ.get("KVTIER_BIN") or str(REPO / "target" / "release" / "kvtier")
    data = scratch / "kvtier-data"
    server = subprocess.Popen([binary, "serve", "--data-dir", str(data), "--memory", "8GiB", "--disk", "16GiB",
                               "--listen", "off", "--admin", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    assert line.startswith("kvtier serving"), line
    admin = next(p for p in line.replace(",", " ").split() if p.startswith("http://"))
    url = f"unix://{data / 'kvtier.sock'}"
    summary = {"gpu": torch.cuda.get_device_name(0), "prompt_tokens": len(PROMPT)}
    try:
        connector = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"kvtier_url": url, "skip_slow_loads": False}}
        cold, hit = run_engine(str(model), connector, ["run", "reset", "run"], scratch, "connector-a")
        (second,) = run_engine(str(model), connector, ["run"], scratch, "connector-b")
        full = len(PROMPT) // 16 * 16
        assert cold["cached"] == 0, cold
        assert hit["cached"] >= full - 16 and second["cached"] >= full - 16, (hit["cached"], second["cached"])
        assert same(hit, cold) and same(second, cold), "a kvtier hit changed the output"
        summary["connector"] = {"cached_tokens": hit["cached"], "second_engine_cached": second["cached"],
                                "identical": True}

        tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [{"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm_tier",
                                 "kvtier_url": url}]}}
        (first,) = run_engine(str(model), tier, ["run"], scratch, "tier-a")
        with urllib.request.urlopen(admin + "/stats", timeout=10) as r:
            stored = json.load(r)["store"]["puts"]
        (promoted,) = run_engine(str(model), tier, ["run"], scratch, "tier-b")
        assert first["cached"] == 0, first
        assert promoted["cached"] > 0, f"engine B found nothing in kvtier (puts {stored})"
        assert same(promoted, first), "a block promoted from kvtier changed the output"
        summary["tier"] = {"kvtier_puts_after_a": stored, "engine_b_cached": promoted["cached"], "identical": True}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print(json.dumps(summary, indent=2))
    print("gpu check passed")


if __name__ == "__main__":
    sys.exit(main())
