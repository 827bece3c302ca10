"""Real SGLang host pools on CPU and a kvtier backend created the way SGLang
creates it (StorageBackendFactory, "dynamic"). Shared by the SGLang tests
and the second process they start."""

import hashlib
import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 16
LAYERS = 3


def host_pool(kind: str, layout: str):
    if kind == "mha":
        device = MHATokenToKVPool(1024, PAGE, torch.float32, 2, 32, LAYERS, "cpu", False, start_layer=0,
                                  end_layer=LAYERS - 1)
        return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                    pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                    end_layer=LAYERS - 1, write_back_staging=device.hicache_write_back_staging)
    device = MLATokenToKVPool(1024, PAGE, torch.float32, 64, 16, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)
    return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=device.size, start_layer=0,
                                end_layer=LAYERS - 1, target_layer_num=LAYERS)


def backend(kind: str, layout: str, url: str, tp_rank: int = 0, tp_size: int = 1, staging_size: int | None = None,
            model: str = "tiny-test-model", **options):
    pool = host_pool(kind, layout)
    extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
             "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "kvtier_url": url, **options}
    if model == "tiny-test-model":
        # A made-up model has no weights to fingerprint: pinned.
        extra.setdefault("model_fingerprint", "test:tiny-test-model")
    if staging_size is not None:
        extra["staging_size"] = staging_size
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage, pool


def sidecar_pools(kind: str, kv_pool) -> dict:
    """Real v2 sidecar host pools on CPU, by SGLang pool name: for MHA a
    sliding-window KV pool (its own geometry, indices shared with the KV
    pool) and a Mamba state pool (its own slots, one per page); for MLA a
    second MLA-shaped pool (a draft model's, replicated across ranks) and
    the Mamba pool (per rank)."""
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    pools = {}
    if kind == "mha":
        swa = MHATokenToKVPool(1024, PAGE, torch.float32, 1, 16, 2, "cpu", False, start_layer=0, end_layer=1)
        pools["swa"] = MHATokenToKVPoolHost(swa.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                            kv_pool.layout, pin_memory=False, device_capacity_tokens=swa.size,
                                            start_layer=0, end_layer=1)
    else:
        draft = MLATokenToKVPool(1024, PAGE, torch.float32, 32, 16, 1, "cpu", False, start_layer=0, end_layer=0)
        pools["draft"] = MLATokenToKVPoolHost(draft.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                              kv_pool.layout, pin_memory=False, device_capacity_tokens=draft.size,
                                              start_layer=0, end_layer=0, target_layer_num=1)
    state = MambaStateBufferInfo(temporal=torch.zeros(2, 32, 4, 8), conv=(torch.zeros(2, 32, 3, 24),))
    pools["mamba"] = MambaPoolHost(state, 2, 0, device_capacity=32, pin_memory=False, device="cpu",
                                   layout="page_first")
    return pools


def hybrid_backend(kind: str, layout: str, url: str, tp_rank: int = 0, tp_size: int = 1,
                   staging_size: int | None = None):
    storage, pool = backend(kind, layout, url, tp_rank=tp_rank, tp_size=tp_size, staging_size=staging_size)
    sidecars = sidecar_pools(kind, pool)
    for name, sidecar in sidecars.items():
        storage.register_mem_host_pool_v2(sidecar, name)
    return storage, pool, sidecars


def pool_page_bytes(pool, indices: torch.Tensor) -> bytes:
    """A pool's bytes of the pages at `indices`, as its own page
    description (get_page_buffer_meta) lists them."""
    import ctypes

    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


def fill_randomly(pool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    buffers = pool.get_hybrid_pool_buffer() if hasattr(pool, "get_hybrid_pool_buffer") else [pool.kv_buffer]
    for b in buffers:
        b.copy_(torch.randn(b.shape, generator=generator, dtype=torch.float32).to(b.dtype))


def in_another_process(args: dict) -> dict:
    """Runs this file's __main__ in a fresh interpreter (another engine
    process) and returns the JSON it prints."""
    import pathlib
    import subprocess

    here = pathlib.Path(__file__).parent
    out = subprocess.run([sys.executable, str(here / "sglang_pools.py"), json.dumps(args)], capture_output=True,
                         text=True, timeout=300, cwd=here)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def tokens(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def page_bytes(pool, pages: list[int]) -> bytes:
    """The pool's bytes of `pages`, in page order (any layout)."""
    dim = list(pool.kv_buffer.shape).index(pool.size)
    return pool.kv_buffer.index_select(dim, tokens(pages)).contiguous().numpy().tobytes()


def v2_transfers(kind: str, keys: list[str], pages: list[int], slots: list[int]):
    """PoolTransfers of the sidecars for `keys`: pages share the KV pool's
    token indices; Mamba states take one slot per key."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    name = "swa" if kind == "mha" else "draft"
    return [PoolTransfer(name=name, host_indices=tokens(pages), keys=list(keys)),
            PoolTransfer(name="mamba", host_indices=torch.tensor(slots), keys=list(keys))]


if __name__ == "__main__" and json.loads(sys.argv[1]).get("v2"):
    # Another process: load every pool's pages another backend saved.
    args = json.loads(sys.argv[1])
    storage, pool, sidecars = hybrid_backend(args["kind"], args["layout"], args["url"], tp_rank=args.get("tp_rank", 0),
                                             tp_size=args.get("tp_size", 1))
    got = storage.batch_get_v2(v2_transfers(args["kind"], args["keys"], args["pages"], args["slots"]))
    digests = {name: hashlib.sha256(pool_page_bytes(p, tokens(args["pages"]) if name != "mamba"
                                                    else torch.tensor(args["slots"]))).hexdigest()
               for name, p in sidecars.items()}
    ok_kv = storage.batch_get_v1(args["keys"], tokens(args["pages"]))
    digests["kv"] = hashlib.sha256(page_bytes(pool, args["pages"])).hexdigest()
    print(json.dumps({"ok": {str(k): v for k, v in got.items()}, "ok_kv": ok_kv, "sha256": digests}))
elif __name__ == "__main__":
    # Another process: load pages another backend instance saved.
    args = json.loads(sys.argv[1])
    storage, pool = backend(args["kind"], args["layout"], args["url"], tp_rank=args.get("tp_rank", 0),
                            tp_size=args.get("tp_size", 1))
    ok = storage.batch_get_v1(args["keys"], tokens(args["pages"]))
    print(json.dumps({"ok": ok, "sha256": hashlib.sha256(page_bytes(pool, args["pages"])).hexdigest(),
                      "exists": storage.batch_exists(args["keys"])}))
