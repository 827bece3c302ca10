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


def backend(kind: str, layout: str, url: str, tp_rank: int = 0, tp_size: int = 1, staging_size: int | None = None):
    pool = host_pool(kind, layout)
    extra = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
             "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "kvtier_url": url}
    if staging_size is not None:
        extra["staging_size"] = staging_size
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=kind == "mla", enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name="tiny-test-model", extra_config=extra,
    )
    storage = StorageBackendFactory.create_backend("dynamic", config, pool)
    storage.register_mem_pool_host(pool)
    return storage, pool


def tokens(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def page_bytes(pool, pages: list[int]) -> bytes:
    """The pool's bytes of `pages`, in page order (any layout)."""
    dim = list(pool.kv_buffer.shape).index(pool.size)
    return pool.kv_buffer.index_select(dim, tokens(pages)).contiguous().numpy().tobytes()


if __name__ == "__main__":
    # Another process: load pages another backend instance saved.
    args = json.loads(sys.argv[1])
    storage, pool = backend(args["kind"], args["layout"], args["url"], tp_rank=args.get("tp_rank", 0),
                            tp_size=args.get("tp_size", 1))
    ok = storage.batch_get_v1(args["keys"], tokens(args["pages"]))
    print(json.dumps({"ok": ok, "sha256": hashlib.sha256(page_bytes(pool, args["pages"])).hexdigest(),
                      "exists": storage.batch_exists(args["keys"])}))
