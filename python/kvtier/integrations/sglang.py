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
page hash, in a namespace naming the model (by its fingerprint), dtype,
page size, layout, rank and geometry. Pages move between the host pool and a staging area of
kvtier's shared memory with one vectorised copy per batch; the server
gathers and scatters the segments itself. ``batch_exists`` is kvtier's
``prefix_len``. Every read is verified by the server: a missing or corrupt
page is reported as not loaded, and SGLang recomputes it.

Interface v2 (hybrid models: a ``PoolTransfer`` per host pool, the KV pool
plus sidecars such as sliding-window, Mamba state and indexer pools) stores
one value per page per pool: the KV pool's pages under SGLang's page hash
exactly as v1 (so v1 and v2 read each other's pages), every other pool's
under ``<pool tag>/<page hash>``, the tag a digest of the pool's kind and
geometry (and the tensor-parallel rank for pools that differ per rank).
Every pool of a batch moves in one multi-buffer call per staging round.

SGLang calls a backend from its backup thread (sets) and its prefetch
thread (gets) at once, so sets and gets each stage through their own area,
each behind a lock.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from .. import KvtierError, errors
from ._common import (
    FailedKeys,
    connect,
    model_label,
    namespace_for,
    namespace_prefix,
    put_replacing,
    read_config_json,
    resolve_url,
    staging_segments,
)
from ._fingerprint import model_fingerprint
from ._host_segments import HostBuffers, SegmentCopy, copy_segments

logger = logging.getLogger("kvtier.sglang")

# Shared memory for staging, split evenly between sets and gets.
DEFAULT_STAGING_SIZE = 256 << 20

# Host pool classes whose bytes are the same on every tensor-parallel rank of
# an MLA model: one rank writes them (as v1 writes MLA KV). Every other pool
# is keyed per rank.
REPLICATED_POOL_CLASSES = ("MLATokenToKVPoolHost", "DSAIndexerPoolHost")


class _Staging:
    """One direction's staging area in kvtier's shared memory."""

    def __init__(self, client, size: int):
        self.buffer = client.alloc_buffer(size)
        self.ptr = self.buffer.ptr
        self.bytes = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self.lock = threading.Lock()
        self.typed = None  # v1's view in the KV pool's own layout


@dataclass
class _Pool:
    """A registered host pool as v2 moves it: a page is its
    ``get_page_buffer_meta`` segments back to back."""

    name: str
    host: Any
    page_size: int
    segment_sizes: np.ndarray  # of one page, in order
    page_bytes: int
    buffers: HostBuffers
    key_prefix: str
    replicated: bool


def _as_name(name) -> str:
    return name.value if isinstance(name, PoolName) else str(name)


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a kvtier server (zero-copy v1 API)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.config = storage_config
        extra = dict(storage_config.extra_config or {}) if storage_config is not None else {}
        self.url = resolve_url(extra.get("kvtier_url"))
        self.staging_size = int(extra.get("staging_size", DEFAULT_STAGING_SIZE))
        self.pinned_fingerprint = extra.get("model_fingerprint")
        # Pages whose load failed: not offered again until stored again.
        self.failed = FailedKeys()
        self.prefix = namespace_prefix(extra.get("namespace_prefix"))
        self.is_writer = storage_config.is_storage_writer if storage_config is not None else True
        self.client = None
        self.mem_pool_host = None
        self.pools: dict[str, _Pool] = {}
        self.counters = {"loaded_pages": 0, "load_failures": 0, "saved_pages": 0, "save_failures": 0}

    # Setup.

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        buffer = mem_pool_host.kv_buffer
        if buffer is None:
            # A logical anchor (DeepSeek V4): the KV pool only hands out
            # indices; every byte lives in v2 sidecar pools.
            self._register_logical_anchor(mem_pool_host)
            return
        if not buffer.is_contiguous() or buffer.device.type != "cpu":
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
        half = self.staging_size // 2
        self.pages_per_batch = max(1, half // self.page_bytes)
        area = max(half, self.pages_per_batch * self.page_bytes)
        self._connect(area)
        shape = dims[: self.token_dim] + [self.pages_per_batch * self.page_size] + dims[self.token_dim + 1:]
        for staging in (self.set_staging, self.get_staging):
            typed = staging.bytes[: self.pages_per_batch * self.page_bytes]
            staging.typed = typed.view(buffer.dtype).view(shape)
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
        self.pools[PoolName.KV.value] = self._describe_pool(PoolName.KV.value, mem_pool_host)

    def _connect(self, area: int) -> None:
        self.client = connect(self.url, self.namespace, shm_size=2 * area)
        self.set_staging = _Staging(self.client, area)
        self.get_staging = _Staging(self.client, area)

    def _register_logical_anchor(self, anchor) -> None:
        self.page_size = anchor.page_size
        self.page_bytes = 0
        self.namespace = self._namespace(anchor, geometry=[])
        self._connect(self.staging_size // 2)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _as_name(host_pool_name)
        if name == PoolName.KV.value:
            return  # the anchor, registered through register_mem_pool_host
        if self.client is None:
            raise ValueError("kvtier: register the KV host pool (register_mem_pool_host) before its sidecars")
        self.pools[name] = self._describe_pool(name, host_pool)
        logger.info("kvtier: pool %s: %d-byte pages, keys under %s", name, self.pools[name].page_bytes,
                    self.pools[name].key_prefix or "the page hash")

    def _namespace(self, pool, geometry=None) -> str:
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
                "label": model_label(read_config_json(c.model_name)),
                "fingerprint": model_fingerprint(c.model_name or "", _server_arg("revision"),
                                                 _engine_config(c.model_name), self.pinned_fingerprint,
                                                 engine="SGLang"),
                "dtype": str(pool.dtype).removeprefix("torch."),
                "rank": rank,
                "page_size": pool.page_size,
                "layout": pool.layout,
                "pool": type(pool).__name__,
                "geometry": geometry if geometry is not None else [
                    d for i, d in enumerate(pool.kv_buffer.shape) if i != self.token_dim],
                "split_heads": bool(getattr(c, "should_split_heads", False)),
                "value_layout": "segments of get_page_buffer_meta, in order",
            },
            self.prefix,
        )

    # The zero-copy interface SGLang's cache controller uses.

    def _pages(self, host_indices: torch.Tensor, n: int) -> list[int]:
        starts = host_indices.view(-1)[:: self.page_size][:n]
        return [int(t) for t in starts]

    def _segment_lists(self, staging: _Staging, count: int) -> tuple[list[list[int]], list[list[int]]]:
        per_leading = self.pages_per_batch * self.page_size * self.token_bytes
        return staging_segments(
            staging.ptr,
            [j * per_leading for j, _ in self.segments],
            self.page_size * self.token_bytes,
            [s for _, s in self.segments],
            count,
        )

    def _token_index(self, starts: list[int]) -> torch.Tensor:
        offsets = torch.arange(self.page_size)
        return (torch.tensor(starts).unsqueeze(1) + offsets).reshape(-1)

    def _staged(self, staging: _Staging, count: int) -> torch.Tensor:
        return staging.typed.narrow(self.token_dim, 0, count * self.page_size)

    def _require_kv_buffer(self) -> None:
        if self.mem_pool_host is None or self.mem_pool_host.kv_buffer is None:
            raise ValueError("kvtier: interface v1 needs a KV host pool with bytes (this one is a logical anchor)")

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        self._require_kv_buffer()
        if not self.is_writer:
            return [True] * len(keys)
        results: list[bool] = []
        starts = self._pages(host_indices, len(keys))
        staging = self.set_staging
        for at in range(0, len(keys), self.pages_per_batch):
            chunk_keys = keys[at:at + self.pages_per_batch]
            chunk = starts[at:at + self.pages_per_batch]
            try:
                with staging.lock:
                    torch.index_select(self.mem_pool_host.kv_buffer, self.token_dim, self._token_index(chunk),
                                       out=self._staged(staging, len(chunk)))
                    ptrs, sizes = self._segment_lists(staging, len(chunk))
                    codes = put_replacing(self.client, chunk_keys, ptrs, sizes, self.failed.take(chunk_keys))
            except KvtierError as e:
                logger.warning("kvtier: saving %d pages failed: %s", len(chunk_keys), e)
                codes = [errors.IO] * len(chunk_keys)
            ok = [c == errors.OK for c in codes]
            self.counters["saved_pages"] += sum(ok)
            self.counters["save_failures"] += len(ok) - sum(ok)
            results.extend(ok)
        return results

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        self._require_kv_buffer()
        results: list[bool] = []
        starts = self._pages(host_indices, len(keys))
        staging = self.get_staging
        for at in range(0, len(keys), self.pages_per_batch):
            chunk_keys = keys[at:at + self.pages_per_batch]
            chunk = starts[at:at + self.pages_per_batch]
            with staging.lock:
                ptrs, sizes = self._segment_lists(staging, len(chunk))
                try:
                    got = self.client.batch_get_into_multi_buffers(chunk_keys, ptrs, sizes)
                except KvtierError as e:
                    logger.warning("kvtier: loading %d pages failed: %s", len(chunk_keys), e)
                    got = [errors.IO] * len(chunk_keys)
                ok = [g == self.page_bytes for g in got]
                self.failed.add(k for k, good in zip(chunk_keys, ok) if not good)
                good = [i for i, k in enumerate(ok) if k]
                if good:
                    source = self._staged(staging, len(chunk))
                    if len(good) < len(chunk):
                        source = source.index_select(self.token_dim,
                                                     self._token_index([i * self.page_size for i in good]))
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
            trusted = self.failed.cut(keys)
            return self._lookup_client().prefix_len(trusted) if trusted else 0
        except KvtierError as e:
            logger.warning("kvtier: lookup failed, treating as a miss: %s", e)
            return 0

    # Interface v2: several host pools per batch (hybrid models).

    def _describe_pool(self, name: str, host) -> _Pool:
        get_buffers = getattr(host, "get_hybrid_pool_buffer", None)
        tensors = get_buffers() if get_buffers is not None else [getattr(host, "kv_buffer", None)]
        buffers = HostBuffers(tensors)
        page_size = int(getattr(host, "page_size", 1) or 1)
        ptrs, sizes = host.get_page_buffer_meta(torch.arange(0, page_size))
        ptrs, sizes = np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
        if len(sizes) == 0 or (sizes <= 0).any():
            raise ValueError(f"kvtier: pool {name} describes a page with no bytes")
        buffers.locate(ptrs, sizes)  # raises if the description and the buffers disagree
        c = self.config
        replicated = bool(c.is_mla_model) and type(host).__name__ in REPLICATED_POOL_CLASSES
        if name == PoolName.KV.value:
            prefix = ""
        else:
            described = {
                "pool": name,
                "kind": type(host).__name__,
                "layout": getattr(host, "layout", None),
                "page_size": page_size,
                "segment_sizes": sizes.tolist(),
                "dtypes": [str(t.dtype) for t in tensors if t is not None],
                "shapes": [list(t.shape[1:]) for t in tensors if t is not None],
                # Replicated pools are one value for every rank; the rest
                # differ per tensor-parallel rank even beside an MLA KV pool.
                "rank": None if replicated else f"tp{c.tp_rank}of{c.tp_size}",
            }
            digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
            prefix = f"{name[:24]}.{digest}/"
        return _Pool(name, host, page_size, sizes, int(sizes.sum()), buffers, prefix, replicated)

    def _pool(self, name) -> _Pool:
        pool = self.pools.get(_as_name(name))
        if pool is None:
            raise ValueError(f"kvtier: host pool {_as_name(name)} was not registered (register_mem_host_pool_v2)")
        return pool

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info=None) -> PoolTransferResult:
        n = len(keys)
        if n == 0 or self.client is None:
            return PoolTransferResult(0, {}, [])
        logical = PoolName.KV.value not in self.pools
        asked = [] if logical else list(keys)
        plans = []
        for transfer in pool_transfers or []:
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise ValueError(f"kvtier: hit policy {transfer.hit_policy} is not supported")
            pool = self._pool(transfer.name)
            plans.append((transfer, len(asked)))
            asked.extend(pool.key_prefix + k for k in keys)
        try:
            # Every pool's pages in one round trip.
            present = [bool(p) and not bad
                       for p, bad in zip(self.client.batch_is_exist(asked), self.failed.known(asked))] if asked else []
        except KvtierError as e:
            logger.warning("kvtier: lookup failed, treating as a miss: %s", e)
            return PoolTransferResult(0, {}, [])
        kv_pages = n if logical else (present.index(False) if False in present[:n] else n)
        hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        # Every prefix length some pool cannot restore is struck; a trailing
        # pool leaves holes, which SGLang intersects across ranks.
        restorable = set(range(1, kv_pages + 1))
        for transfer, start in plans:
            exists = present[start:start + kv_pages]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = exists.index(False) if False in exists else kv_pages
                usable = set(range(1, boundary + 1))
            else:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                usable = {p for p in range(1, kv_pages + 1) if all(exists[max(0, p - window):p])}
                boundary = max(usable, default=0)
            if boundary:
                hits[transfer.name] = boundary
            restorable &= usable
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict:
        return self._io_v2(transfers, is_set=False)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict:
        return self._io_v2(transfers, is_set=True)

    def _io_v2(self, transfers: List[PoolTransfer], is_set: bool) -> dict:
        results: dict = {}
        # (result list, index, key, pool, that page's buffer/offset arrays)
        pages = []
        for transfer in transfers:
            pool = self._pool(transfer.name)
            keys = list(transfer.keys or [])
            out = results.setdefault(transfer.name, [False] * len(keys))
            if not keys:
                continue
            if is_set and pool.replicated and not self.is_writer:
                out[:] = [True] * len(keys)  # the writer rank stores these bytes
                continue
            indices = transfer.host_indices.detach().to("cpu").reshape(-1)
            if indices.numel() != len(keys) * pool.page_size:
                raise ValueError(f"kvtier: pool {pool.name}: {len(keys)} keys for {indices.numel()} host indices "
                                 f"(page size {pool.page_size})")
            ptrs, sizes = pool.host.get_page_buffer_meta(indices)
            ptrs, sizes = np.asarray(ptrs, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
            per_page = len(pool.segment_sizes)
            if len(sizes) != len(keys) * per_page or not np.array_equal(
                    sizes.reshape(len(keys), per_page), np.broadcast_to(pool.segment_sizes, (len(keys), per_page))):
                raise ValueError(f"kvtier: pool {pool.name} described its pages differently than at registration")
            which, offsets = pool.buffers.locate(ptrs, sizes)
            which, offsets = which.reshape(len(keys), per_page), offsets.reshape(len(keys), per_page)
            for i, key in enumerate(keys):
                pages.append((out, i, pool.key_prefix + key, pool, which[i], offsets[i]))
        staging = self.set_staging if is_set else self.get_staging
        area = staging.bytes.numel()
        failed: set[str] = set()
        at = 0
        while at < len(pages):
            # One round: as many pages as the staging area holds, every pool.
            batch, used = [], 0
            while at < len(pages):
                page = pages[at]
                pool = page[3]
                if not is_set and pool.name in failed:
                    at += 1  # past a pool's first miss nothing more of it is usable
                    continue
                if pool.page_bytes > area:
                    raise ValueError(f"kvtier: a {pool.name} page ({pool.page_bytes} bytes) is larger than the "
                                     f"staging area ({area} bytes): raise staging_size")
                if used + pool.page_bytes > area:
                    break
                batch.append((page, used))
                used += pool.page_bytes
                at += 1
            if not batch:
                continue
            with staging.lock:
                self._round_v2(staging, batch, is_set, failed)
        return results

    def _round_v2(self, staging: _Staging, batch, is_set: bool, failed: set) -> None:
        def copies(selected) -> dict:
            by_pool: dict[str, list] = {}
            for page, at in selected:
                by_pool.setdefault(page[3].name, []).append((page, at))
            out = {}
            for name, entries in by_pool.items():
                pool = entries[0][0][3]
                within = np.cumsum(pool.segment_sizes) - pool.segment_sizes
                out[name] = (pool, SegmentCopy(
                    buffer=np.concatenate([p[4] for p, _ in entries]),
                    offset=np.concatenate([p[5] for p, _ in entries]),
                    staged=np.concatenate([at + within for _, at in entries]),
                    size=np.tile(pool.segment_sizes, len(entries)),
                ))
            return out

        keys = [page[2] for page, _ in batch]
        ptrs = [[staging.ptr + at] for _, at in batch]
        sizes = [[page[3].page_bytes] for page, _ in batch]
        if is_set:
            for pool, copy in copies(batch).values():
                copy_segments(pool.buffers, copy, staging.bytes, to_staging=True)
            try:
                codes = put_replacing(self.client, keys, ptrs, sizes, self.failed.take(keys))
            except KvtierError as e:
                logger.warning("kvtier: saving %d pages failed: %s", len(keys), e)
                codes = [errors.IO] * len(keys)
            for (page, _), code in zip(batch, codes):
                page[0][page[1]] = code == errors.OK
            stored = sum(c == errors.OK for c in codes)
            self.counters["saved_pages"] += stored
            self.counters["save_failures"] += len(codes) - stored
            return
        try:
            got = self.client.batch_get_into_multi_buffers(keys, ptrs, sizes)
        except KvtierError as e:
            logger.warning("kvtier: loading %d pages failed: %s", len(keys), e)
            got = [errors.IO] * len(keys)
        # A pool's pages after its first miss are not copied in: SGLang uses
        # only each pool's leading run, and that host memory stays as it was.
        usable = []
        for (page, at), g in zip(batch, got):
            name = page[3].name
            if name in failed:
                continue
            if g == page[3].page_bytes:
                usable.append((page, at))
            else:
                failed.add(name)
                self.failed.add([page[2]])
        for pool, copy in copies(usable).values():
            copy_segments(pool.buffers, copy, staging.bytes, to_staging=False)
        for page, _ in usable:
            page[0][page[1]] = True
        self.counters["loaded_pages"] += len(usable)
        self.counters["load_failures"] += len(batch) - len(usable)

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
        return dict(self.counters, failed_pages_held_back=len(self.failed), failed_pages_replaced=self.failed.replaced)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# What SGLang's server arguments hold beyond config.json that changes a
# page's bytes (docs/integrations.md says why for each).
_NUMERICS_ARGS = ("json_model_override_args", "dtype", "kv_cache_dtype", "quantization", "quantization_param_path",
                  "revision", "attention_backend", "enable_fp32_lm_head")


def _server_arg(name: str):
    try:
        from sglang.srt.runtime_context import get_server_args

        return getattr(get_server_args(), name, None)
    except Exception:  # noqa: BLE001 - outside a running server (a test harness)
        return None


def _engine_config(model: str | None) -> dict:
    """The model's configuration as this server runs it: its config.json,
    and the server arguments that override or change its numerics, when
    the running server's arguments are published (always inside SGLang; a
    harness without them pins ``model_fingerprint`` or accepts config.json
    alone, logged)."""
    fields: dict = {"config.json": read_config_json(model)}
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        if args is not None and getattr(args, "model_path", None) == model:
            fields["server_args"] = {name: getattr(args, name, None) for name in _NUMERICS_ARGS}
    except Exception as e:  # noqa: BLE001 - see above
        logger.info("kvtier: SGLang's server arguments are not published here (%s): the namespace covers "
                    "config.json and the weights only", e)
    return fields

