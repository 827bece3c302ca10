"""vLLM's real tiered offloading manager (TieringOffloadingSpec: a CPU
primary region in /dev/shm and kvtier as its secondary tier), built from an
OffloadingConfig the way vLLM builds it, and driven the way vLLM's scheduler
drives it. Shared by the tier tests and the second process they start."""

import hashlib
import json
import sys
import time
import uuid

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_BYTES = 16384  # one worker's KV bytes per block; one block per chunk
TIER = {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm_tier"}


def manager(url: str, chunks: int = 8, model: str = "tiny-test-model", groups: int = 1):
    """A manager for a model of ``groups`` KV cache groups (a hybrid model
    when more than one: full attention and sliding-window layers, say)."""
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layers.{g}",), group_id=g)
                     for g in range(groups)),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunks * BLOCK_BYTES,
                      # A made-up model has no weights to fingerprint: pinned.
                      "secondary_tiers": [dict(TIER, kvtier_url=url, model_fingerprint=f"test:{model}")]},
        engine_id=f"kvtier-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False),
    )
    return TieringOffloadingSpec(config).get_manager()


def keys(n: int, salt: str = "", group: int = 0) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{salt}block-{i}".encode()).digest(), group) for i in range(n)]


def pattern(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_256(key).digest(BLOCK_BYTES), dtype=np.uint8)


def primary(m) -> np.ndarray:
    return np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)


def step(m) -> None:
    m.on_schedule_end(ScheduleEndContext((), ()))


def settle(m, timeout: float = 20.0) -> None:
    """Steps the manager until no transfer is in flight."""
    deadline = time.monotonic() + timeout
    step(m)
    while m.has_pending_work():
        assert time.monotonic() < deadline, "transfers never finished"
        time.sleep(0.002)
        step(m)


def reset_primary(m) -> None:
    """What vLLM does on sleep or a weight update: the primary tier forgets
    every chunk (kvtier keeps them), and its memory is wiped here so only
    kvtier can fill it back. From vLLM 0.33 on, promotions are held after a
    reset until the workers confirm no late write is in flight
    (`on_reset_flushed`, which the scheduler calls then)."""
    m.reset_cache()
    if hasattr(m, "on_reset_flushed"):
        m.on_reset_flushed()
    primary(m)[:] = 0


def store(m, ks: list[bytes], req_id: str = "writer") -> None:
    """What the GPU worker and the scheduler do for a stored request: the
    chunks land in the primary region, then cascade to the tiers."""
    req = ReqContext(req_id=req_id)
    m.on_new_request(req)
    out = m.prepare_store(ks, req)
    assert out is not None and list(out.keys_to_store) == list(ks)
    view = primary(m)
    for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
        view[chunk] = pattern(key)
    m.complete_store(out.keys_to_store, req)
    m.on_request_finished(req)
    settle(m)


def resolve(m, key: bytes, req: ReqContext, timeout: float = 20.0) -> LookupResult:
    """The scheduler's lookup loop for one chunk: asked again each step
    while the answer is RETRY or HIT_PENDING (a promotion in flight)."""
    deadline = time.monotonic() + timeout
    while True:
        result = m.lookup(key, req)
        if result in (LookupResult.HIT, LookupResult.MISS):
            return result
        assert time.monotonic() < deadline, f"lookup stuck at {result}"
        step(m)
        time.sleep(0.002)


def load(m, ks: list[bytes], req_id: str = "reader") -> list[bool]:
    """Looks each chunk up (promoting it from kvtier into the primary
    region) and checks the primary's bytes; per key whether it hit with
    the stored bytes."""
    req = ReqContext(req_id=req_id)
    m.on_new_request(req)
    hits = [resolve(m, k, req) is LookupResult.HIT for k in ks]
    found = [k for k, h in zip(ks, hits) if h]
    right = {}
    if found:
        spec = m.prepare_load(found, req)
        view = primary(m)
        for key, chunk in zip(found, spec.chunk_ids):
            right[key] = bool(np.array_equal(view[chunk], pattern(key)))
        m.complete_load(found, req)
    m.on_request_finished(req)
    settle(m)
    return [h and right[k] for k, h in zip(ks, hits)]


if __name__ == "__main__":
    # Another process (another vLLM instance): find and load what the
    # first one's tier stored.
    args = json.loads(sys.argv[1])
    m = manager(args["url"])
    try:
        print(json.dumps({"loaded": load(m, [bytes.fromhex(k) for k in args["keys"]])}))
    finally:
        m.shutdown()
