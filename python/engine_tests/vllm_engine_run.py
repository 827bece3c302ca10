"""One real vLLM engine on CPU (VLLM_ENABLE_V1_MULTIPROCESSING=1: the
scheduler and the worker are separate processes) with the kvtier connector,
driven by a list of steps; prints one JSON line per result. Run by
test_vllm_e2e.py as a subprocess."""

import json
import sys


def emit(**fields):
    print("RESULT " + json.dumps(fields), flush=True)


def main():
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvtier.integrations.vllm import connector_namespace

    transfer = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        # A tiny model computes faster than most loads: keep every hit, the
        # point here is the bytes (the cost rule has its own test).
        kv_connector_extra_config={"kvtier_url": args["url"], "async_loads": args.get("async_loads", True),
                                   "skip_slow_loads": False},
    )
    llm = LLM(
        model=args["model"], skip_tokenizer_init=True, dtype="float32", block_size=32,
        max_model_len=2048, enforce_eager=True, gpu_memory_utilization=0.1, seed=0,
        kv_transfer_config=transfer if args.get("connector", True) else None,
        **({"hf_overrides": args["hf_overrides"]} if args.get("hf_overrides") else {}),
    )
    params = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0, logprobs=5, detokenize=False)
    prompt = {"prompt_token_ids": args["prompt"]}
    for step in args["steps"]:
        if step == "run":
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            completion = out.outputs[0]
            emit(
                cached=out.num_cached_tokens,
                tokens=list(completion.token_ids),
                logprobs=[sorted((t, lp.logprob) for t, lp in d.items()) for d in completion.logprobs],
            )
        elif step == "reset":
            assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
        elif step == "keys":
            from vllm.sampling_params import SamplingParams as SP
            from vllm.utils.hashing import get_hash_fn_by_name
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
            from vllm.v1.request import Request

            config = llm.llm_engine.vllm_config
            hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            request = Request("probe", args["prompt"], SP(max_tokens=1), None,
                              block_hasher=get_request_block_hasher(32, hash_fn))
            emit(namespace=connector_namespace(config, 0, 0), keys=[bytes(h).hex() for h in request.block_hashes])
        elif step == "pause":
            emit(paused=True)
            sys.stdin.readline()
        else:
            raise ValueError(step)


if __name__ == "__main__":
    main()
