"""An SGLang HiCache storage backend backed by ``kvtier serve``.

Load it by configuration alone::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang", "class_name": "KvtierHiCacheStorage",
            "interface_v1": 1, "kvtier_url": "unix:///run/kvtier/kvtier.sock"}'

One kvtier value per page: the page's segments in the order SGLang's host
pool lists them (``get_page_buffer_meta``: K and V for MHA, per layer in the
``layer_first`` layout; one part per layer or page for MLA), under SGLang's
page hash, in a namespace naming the model, dtype, page size, layout, rank
and geometry. Pages move between the host pool and a staging area of
kvtier's shared memory with one vectorised copy per batch; the server
gathers and scatters the segments itself. ``batch_exists`` is kvtier's
``prefix_len``. Every read is verified by the server: a missing or corrupt
page is reported as not loaded, and SGLang recomputes it.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .. import KvtierError, errors
from ._common import connect, namespace_for, resolve_url, staging_segments

logger = logging.getLogger("kvtier.sglang")

DEFAULT_STAGING_SIZE = 256 << 20


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a kvtier server (zero-copy v1 API)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = storage_config
        extra = dict(storage_config.extra_config or {}) if storage_config is not None else {}
        self.url = resolve_url(extra.get("kvtier_url"))
        self.staging_size = int(extra.get("staging_size", DEFAULT_STAGING_SIZE))
        self.is_writer = storage_config.is_storage_writer if storage_config is not None else True
        self.client = None
        self.mem_pool_host = None
        # A client in a namespace without the pool's geometry, for the
        # legacy byte API before a pool is registered.
        self.counters = {"loaded_pages": 0, "load_failures": 0, "saved_pages": 0, "save_failures": 0}

    # Setup.

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        buffer = mem_pool_host.kv_buffer
        if buffer is None or not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError("kvtier: the HiCache host pool must be one contiguous CPU tensor")
        size = mem_pool_host.size
        dims = list(buffer.shape)
        if dims.count(size) != 1:
            raise ValueError(f"kvtier: cannot find the token dimension of host pool shape {dims} (size {size})")
        self.token_dim = dims.index(size)
        self.page_size = mem_pool_host.page_size
        self.leading = 1
        for d in dims[: self.token_dim]:
            self.leading *= d
        self.token_bytes = buffer[(0,) * (self.token_dim + 1)].numel() * buffer.element_size()
        self.page_bytes = self.leading * self.page_size * self.token_bytes
        self.namespace = self._namespace(mem_pool_host)
        self.pages_per_batch = max(1, self.staging_size // self.page_bytes)
        staging = self.pages_per_batch * self.page_bytes
        self.client = connect(self.url, self.namespace, shm_size=staging)
        self.staging_buffer = self.client.alloc_buffer(staging)
        shape = dims[: self.token_dim] + [self.pages_per_batch * self.page_size] + dims[self.token_dim + 1:]
        self.staging = torch.frombuffer(self.staging_buffer, dtype=torch.uint8).view(buffer.dtype).view(shape)
        # The segment layout of one page, as SGLang's host pool defines it:
        # (leading index, byte length) per segment, in order.
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(0, self.page_size))
        base = buffer.data_ptr()
        stride = size * self.token_bytes
        self.segments = [((p - base) // stride, s) for p, s in zip(ptrs, sizes)]
        if sum(s for _, s in self.segments) != self.page_bytes or any(
            (p - base) % stride != 0 for p in ptrs
        ):
            raise ValueError(f"kvtier: host pool layout {mem_pool_host.layout!r} is not one kvtier knows")
        logger.info("kvtier: %d-byte pages, %d per batch, namespace %s", self.page_bytes, self.pages_per_batch,
                    self.namespace)

    def _namespace(self, pool) -> str:
        c = self.config
        mla = bool(c.is_mla_model)
        rank = f"pp{c.pp_rank}of{c.pp_size}-" + ("mla" if mla else f"tp{c.tp_rank}of{c.tp_size}")
        if getattr(c, "dcp_size", 1) > 1:
            rank += f"-dcp{c.dcp_rank}of{c.dcp_size}"
        if getattr(c, "attn_cp_size", 1) > 1:
            rank += f"-cp{c.attn_cp_rank}of{c.attn_cp_size}"
        return namespace_for(
            "sglang",
            {
                "model": c.model_name,
                "dtype": str(pool.dtype).removeprefix("torch."),
                "rank": rank,
                "page_size": pool.page_size,
                "layout": pool.layout,
                "pool": type(pool).__name__,
                "geometry": [d for i, d in enumerate(pool.kv_buffer.shape) if i != self.token_dim],
                "split_heads": bool(getattr(c, "should_split_heads", False)),
                "value_layout": "segments of get_page_buffer_meta, in order",
            },
        )

    # The zero-copy interface SGLang's cache controller uses.

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[int]:
        starts = host_indices.view(-1)[:: self.page_size][:n]
        return [int(t) for t in starts]

    def _segment_lists(self, count: int) -> tuple[list[list[int]], list[list[int]]]:
        per_leading = self.pages_per_batch * self.page_size * self.token_bytes
        return staging_segments(
            self.staging_buffer.ptr,
            [j * per_leading for j, _ in self.segments],
            self.page_size * self.token_bytes,
            [s for _, s in self.segments],
            count,
        )

    def _token_index(self, starts: list[int]) -> torch.Tensor:
        offsets = torch.arange(self.page_size)
        return (torch.tensor(starts).unsqueeze(1) + offsets).reshape(-1)

    def _staged(self, count: int) -> torch.Tensor:
        return self.staging.narrow(self.token_dim, 0, count * self.page_size)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        if not self.is_writer:
            return [True] * len(keys)
        results: list[bool] = []
        starts = self._pages(host_indices, len(keys))
        for at in range(0, len(keys), self.pages_per_batch):
            chunk_keys = keys[at:at + self.pages_per_batch]
            chunk = starts[at:at + self.pages_per_batch]
            torch.index_select(self.mem_pool_host.kv_buffer, self.token_dim, self._token_index(chunk),
                               out=self._staged(len(chunk)))
            ptrs, sizes = self._segment_lists(len(chunk))
            try:
                codes = self.client.batch_put_from_multi_buffers(chunk_keys, ptrs, sizes, skip_existing=True)
            except KvtierError as e:
                logger.warning("kvtier: saving %d pages failed: %s", len(chunk_keys), e)
                codes = [errors.IO] * len(chunk_keys)
            ok = [c == errors.OK for c in codes]
            self.counters["saved_pages"] += sum(ok)
            self.counters["save_failures"] += len(ok) - sum(ok)
            results.extend(ok)
        return results

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        results: list[bool] = []
        starts = self._pages(host_indices, len(keys))
        for at in range(0, len(keys), self.pages_per_batch):
            chunk_keys = keys[at:at + self.pages_per_batch]
            chunk = starts[at:at + self.pages_per_batch]
            ptrs, sizes = self._segment_lists(len(chunk))
            try:
                got = self.client.batch_get_into_multi_buffers(chunk_keys, ptrs, sizes)
            except KvtierError as e:
                logger.warning("kvtier: loading %d pages failed: %s", len(chunk_keys), e)
                got = [errors.IO] * len(chunk_keys)
            ok = [g == self.page_bytes for g in got]
            good = [i for i, k in enumerate(ok) if k]
            if good:
                source = self._staged(len(chunk))
                if len(good) < len(chunk):
                    source = source.index_select(self.token_dim, self._token_index([i * self.page_size for i in good]))
                self.mem_pool_host.kv_buffer.index_copy_(
                    self.token_dim, self._token_index([chunk[i] for i in good]), source
                )
            self.counters["loaded_pages"] += len(good)
            self.counters["load_failures"] += len(ok) - len(good)
            results.extend(ok)
        return results

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if not keys:
            return 0
        try:
            return self._lookup_client().prefix_len(keys)
        except KvtierError as e:
            logger.warning("kvtier: lookup failed, treating as a miss: %s", e)
            return 0

    # The older byte-oriented interface (HiCacheStorage's abstract methods).

    def _lookup_client(self):
        if self.client is None:
            raise KvtierError("kvtier: no host pool registered yet (register_mem_pool_host)")
        return self.client

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        client = self._lookup_client()
        out = []
        for i, key in enumerate(keys):
            target = target_locations[i] if target_locations is not None else None
            if isinstance(target, torch.Tensor):
                view = target.view(-1).view(torch.uint8).numpy()
                got = client.get_into(key, view)
                out.append(target if got == view.nbytes else None)
            else:
                value = client.get(key)
                out.append(torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else None)
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations=None, target_sizes=None) -> bool:
        if not self.is_writer:
            return True
        client = self._lookup_client()
        buffers = [v.contiguous().view(-1).view(torch.uint8).numpy() for v in values]
        return all(c == errors.OK for c in client.batch_put_from(keys, buffers, skip_existing=True))

    def clear(self) -> None:
        # The store is shared by every engine on the host: clearing one
        # engine's view must not drop the others' pages.
        logger.warning("kvtier: clear() is not supported on a shared store; nothing was removed")

    def get_stats(self):
        return dict(self.counters)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
