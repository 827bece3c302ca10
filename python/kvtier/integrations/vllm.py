"""A vLLM KV connector backed by ``kvtier serve``.

Load it by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier_url": "unix:///run/kvtier/kvtier.sock"}}'

How it works (``docs/integrations.md`` has the whole story):

- Keys are vLLM's own block hashes (``request.block_hashes``: they already
  cover the tokens, the cache salt, LoRA and multimodal inputs), stored in a
  namespace naming the model, KV dtype, block size, parallel rank and the
  value layout, so blocks of incompatible engines never meet.
- One value per block per rank: the block's KV of every layer, in the
  logical ``[H, N, C]`` order of vLLM's per-layer view, layer after layer. The
  worker copies blocks between vLLM's KV cache and a staging area in
  kvtier's shared memory (one memcpy on CPU; a device-to-host DMA into
  CUDA-registered shared memory on GPU), and the server gathers or scatters
  the layers itself (multi-buffer calls), so no other copy is made.
- The scheduler asks ``prefix_len`` how many leading blocks the store has
  beyond vLLM's local hit; the worker loads them before attention needs them
  (one batch per step, waited for per layer) and saves every newly filled
  prompt block once its layers are computed. A block that fails to load
  (evicted meanwhile, or corrupt on disk: kvtier verifies every read) is
  reported to vLLM, which recomputes it with ``kv_load_failure_policy
  = "recompute"``; its memory is never filled with unverified bytes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .. import KvtierError, errors
from ._common import connect, namespace_for, resolve_url, staging_segments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvtier.vllm")

DEFAULT_STAGING_SIZE = 256 << 20


@dataclass
class BlockTransfer:
    """Blocks of one request to move this step: ``keys[i]`` <-> ``block_ids[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def _parallel_layout(vllm_config: VllmConfig) -> tuple[int, int, bool]:
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size, vllm_config.model_config.use_mla


def connector_namespace(vllm_config: VllmConfig, tp_rank: int, pp_rank: int) -> str:
    """The namespace of one rank's blocks: everything that changes their
    bytes or meaning. MLA caches are the same on every TP rank, so they
    share one namespace (and rank 0 writes it)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    tp, pp, mla = _parallel_layout(vllm_config)
    dtype = str(model.dtype).removeprefix("torch.") if cache.cache_dtype == "auto" else cache.cache_dtype
    rank = f"pp{pp_rank}of{pp}-" + ("mla" if mla else f"tp{tp_rank}of{tp}")
    return namespace_for(
        "vllm",
        {
            "model": model.model,
            "revision": getattr(model, "revision", None),
            "dtype": dtype,
            "block_size": cache.block_size,
            "rank": rank,
            "layers": model.get_num_layers(parallel),
            "kv_heads": model.get_num_kv_heads(parallel),
            "head_size": model.get_head_size(),
            "mla": mla,
            "value_layout": "layers x logical [H, N, C] of the per-layer view",
        },
    )


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector interface over kvtier; the scheduler half or the
    worker half, by role."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._url = resolve_url(extra.get("kvtier_url"))
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            logger.warning(
                "kvtier: kv_load_failure_policy is %r: a block evicted or found corrupt between lookup and "
                "load fails its request instead of being recomputed; set it to \"recompute\"",
                policy,
            )
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, self._url, extra)
        else:
            self._worker = _WorkerSide(vllm_config, self._url, extra)

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.forget(request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        # kvtier is shared by every engine on the host; one engine's prefix
        # cache reset must not drop the others' blocks. Blocks of changed
        # weights belong in a new namespace (a new model path or revision).
        logger.warning("kvtier: reset_connector is not supported; the shared store keeps its blocks")
        return False

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._worker.save_layer(layer_name, meta.saves)

    def wait_for_save(self):
        assert self._worker is not None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvtierConnectorMetadata)
            self._worker.finish_saves(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self):
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()

    def stats(self) -> dict[str, int]:
        """This process's transfer counters (blocks and bytes loaded, saved
        and failed; lookups and hits on the scheduler side)."""
        side = self._scheduler or self._worker
        return dict(side.counters) if side is not None else {}


@dataclass
class _Tracked:
    """Scheduler-side state of a running request."""

    request: Request
    block_ids: list[int]
    # Leading blocks known to be in the store or already saved.
    saved_blocks: int


class _SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, url: str, extra: dict[str, Any]):
        self.block_size = vllm_config.cache_config.block_size
        self.save_decode_blocks = bool(extra.get("save_decode_blocks", False))
        tp, pp, mla = _parallel_layout(vllm_config)
        tp_ranks = [0] if mla else list(range(tp))
        # A block is usable only if every rank has its part.
        self.clients = [
            connect(url, connector_namespace(vllm_config, t, p)) for p in range(pp) for t in tp_ranks
        ]
        # Requests allocated since the last step, with their external tokens.
        self.allocated: dict[str, tuple[Request, int]] = {}
        self.tracked: dict[str, _Tracked] = {}
        self.counters = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0}

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        # At least one token must be left for vLLM to compute.
        usable = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        first = num_computed_tokens // bs
        if usable <= first:
            return 0
        keys = [bytes(h) for h in request.block_hashes[first:usable]]
        self.counters["lookups"] += 1
        try:
            hit = min(c.prefix_len(keys) for c in self.clients)
        except KvtierError as e:
            self.counters["lookup_errors"] += 1
            logger.warning("kvtier: lookup failed, treating as a miss: %s", e)
            return 0
        matched = max(0, (first + hit) * bs - num_computed_tokens)
        self.counters["hit_tokens"] += matched
        return matched

    def after_alloc(self, request: Request, num_external_tokens: int) -> None:
        self.allocated[request.request_id] = (request, num_external_tokens)

    def build_meta(self, out: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata()
        bs = self.block_size
        for new in out.scheduled_new_reqs:
            request, external = self.allocated.pop(new.req_id, (None, 0))
            if request is None:
                continue
            block_ids = list(new.block_ids[0])
            computed = new.num_computed_tokens
            self._add_load(meta, request, block_ids, computed, external)
            # Blocks loaded from the store need no save; vLLM's own prefix
            # hits may not be in the store, so those are offered again
            # (the server skips what it has).
            tracked = _Tracked(request, block_ids, computed // bs if external else 0)
            self.tracked[new.req_id] = tracked
            self._add_save(meta, tracked, computed + out.num_scheduled_tokens.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.tracked.get(req_id)
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                # Resumed after preemption: new_block_ids lists all blocks.
                request, external = self.allocated.pop(req_id, (None, 0))
                request = request or (tracked.request if tracked else None)
                if request is None:
                    continue
                block_ids = list(new_ids[0]) if new_ids is not None else []
                self._add_load(meta, request, block_ids, computed, external)
                saved = max(tracked.saved_blocks if tracked else 0, computed // bs if external else 0)
                tracked = _Tracked(request, block_ids, saved)
                self.tracked[req_id] = tracked
            elif tracked is None:
                continue
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            self._add_save(meta, tracked, computed + out.num_scheduled_tokens.get(req_id, 0))
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        return meta

    def _add_load(self, meta, request, block_ids, computed: int, external: int) -> None:
        if external <= 0:
            return
        bs = self.block_size
        start, end = (computed - external) // bs, computed // bs
        meta.loads.append(
            BlockTransfer(
                request.request_id,
                [bytes(h) for h in request.block_hashes[start:end]],
                block_ids[start:end],
            )
        )

    def _add_save(self, meta, tracked: _Tracked, computed_after_step: int) -> None:
        request = tracked.request
        limit = request.num_tokens if self.save_decode_blocks else request.num_prompt_tokens
        full = min(computed_after_step, limit) // self.block_size
        full = min(full, len(request.block_hashes), len(tracked.block_ids))
        if full <= tracked.saved_blocks:
            return
        start = tracked.saved_blocks
        meta.saves.append(
            BlockTransfer(
                request.request_id,
                [bytes(h) for h in request.block_hashes[start:full]],
                tracked.block_ids[start:full],
            )
        )
        tracked.saved_blocks = full

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.allocated.pop(req_id, None)

    def close(self) -> None:
        for c in self.clients:
            c.close()


class _WorkerSide:
    """Moves blocks between vLLM's KV cache and the store through a staging
    area of kvtier shared memory laid out ``[layer][slot][block bytes]``."""

    def __init__(self, vllm_config: VllmConfig, url: str, extra: dict[str, Any]):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.vllm_config = vllm_config
        self.url = url
        self.staging_size = _size(extra.get("staging_size", DEFAULT_STAGING_SIZE))
        tp_rank = get_tensor_model_parallel_rank()
        pp_rank = get_pp_group().rank_in_group
        _, _, mla = _parallel_layout(vllm_config)
        self.namespace = connector_namespace(vllm_config, tp_rank, pp_rank)
        # MLA ranks hold identical caches: one writes, all read.
        self.saves_enabled = not mla or tp_rank == 0
        self.client = None
        self.layers: list[str] = []
        self.caches: dict[str, torch.Tensor] = {}
        self.counters = {
            "loaded_blocks": 0,
            "loaded_bytes": 0,
            "load_errors": 0,
            "saved_blocks": 0,
            "saved_bytes": 0,
            "save_errors": 0,
        }
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-transfer")
        self.load_errors: set[int] = set()
        self.lock = threading.Lock()
        # This step's load: its future, what it moved, which layers are in.
        self.load: Future | None = None
        self.load_plan: list[tuple[int, BlockTransfer]] = []
        self.load_ok: list[bool] = []
        self.injected: set[str] = set()
        self.save: Future | None = None
        self.save_copied: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        expected = (model.get_num_kv_heads(parallel), self.vllm_config.cache_config.block_size)
        for name, cache in kv_caches.items():
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                raise ValueError(
                    f"kvtier: layer {name}: expected vLLM's per-layer [blocks, heads, tokens, content] "
                    f"KV tensor, got {type(cache).__name__} {getattr(cache, 'shape', '')}"
                )
            if not model.use_mla and tuple(cache.shape[1:3]) != expected:
                raise ValueError(
                    f"kvtier: layer {name} has shape {tuple(cache.shape)}, not [blocks, {expected[0]}, "
                    f"{expected[1]}, content]: this vLLM's KV layout is not one kvtier knows"
                )
        self.layers = list(kv_caches)
        self.caches = dict(kv_caches)
        first = kv_caches[self.layers[0]]
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.layer_bytes = first[0].numel() * first.element_size()
        for name in self.layers:
            c = kv_caches[name]
            if tuple(c.shape[1:]) != self.block_shape or c.dtype != self.dtype:
                raise ValueError(f"kvtier: layer {name} differs from layer {self.layers[0]} in shape or dtype")
        block_bytes = self.layer_bytes * len(self.layers)
        self.slots = max(1, self.staging_size // block_bytes)
        size = self.slots * block_bytes
        self.client = connect(self.url, self.namespace, shm_size=size)
        self.staging_buffer = self.client.alloc_buffer(size)
        raw = torch.frombuffer(self.staging_buffer, dtype=torch.uint8)
        self.staging = raw.view(self.dtype).view(len(self.layers), self.slots, *self.block_shape)
        if self.device.type == "cuda":
            # Device-to-host copies land straight in the memory the server reads.
            rc = torch.cuda.cudart().cudaHostRegister(self.staging_buffer.ptr, size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"kvtier: cudaHostRegister of the staging buffer failed ({rc})")
        logger.info(
            "kvtier: %d layers, %d bytes per block, %d staging slots, namespace %s",
            len(self.layers), block_bytes, self.slots, self.namespace,
        )

    def _segments(self, count: int) -> tuple[list[list[int]], list[list[int]]]:
        layers = len(self.layers)
        per_layer = self.slots * self.layer_bytes
        return staging_segments(
            self.staging_buffer.ptr,
            [layer * per_layer for layer in range(layers)],
            self.layer_bytes,
            [self.layer_bytes] * layers,
            count,
        )

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    # Loads.

    def start_loads(self, loads: list[BlockTransfer]) -> None:
        self._abandon_load()
        plan = [(i, t) for t in loads for i in range(len(t.keys))]
        if not plan:
            return
        if len(plan) <= self.slots:
            # One batch, waited for by the first layer that needs it.
            self.load_plan = plan
            self.load = self.executor.submit(self._fetch, plan)
            return
        # More than the staging area holds: chunk by chunk, all layers each.
        for start in range(0, len(plan), self.slots):
            chunk = plan[start:start + self.slots]
            ok = self._fetch(chunk)
            self._inject_all(chunk, ok)

    def _fetch(self, plan: list[tuple[int, BlockTransfer]]) -> list[bool]:
        keys = [t.keys[i] for i, t in plan]
        ptrs, sizes = self._segments(len(plan))
        want = self.layer_bytes * len(self.layers)
        try:
            got = self.client.batch_get_into_multi_buffers(keys, ptrs, sizes)
        except KvtierError as e:
            logger.warning("kvtier: load of %d blocks failed, vLLM recomputes them: %s", len(keys), e)
            got = [errors.IO] * len(keys)
        ok = [g == want for g in got]
        bad = [t.block_ids[i] for (i, t), good in zip(plan, ok) if not good]
        with self.lock:
            self.load_errors.update(bad)
            self.counters["load_errors"] += len(bad)
            self.counters["loaded_blocks"] += len(keys) - len(bad)
            self.counters["loaded_bytes"] += (len(keys) - len(bad)) * want
        if bad:
            logger.warning("kvtier: %d of %d blocks missing or corrupt, vLLM recomputes them", len(bad), len(keys))
        return ok

    def _inject(self, layer: int, plan, ok: list[bool]) -> None:
        slots = [s for s, good in enumerate(ok) if good]
        if not slots:
            return
        cache = self.caches[self.layers[layer]]
        ids = self._index([plan[s][1].block_ids[plan[s][0]] for s in slots])
        if len(slots) == len(plan):
            source = self.staging[layer, : len(plan)]
        else:
            source = self.staging[layer, torch.tensor(slots, dtype=torch.long)]
        cache.index_copy_(0, ids, source.to(self.device, non_blocking=True))

    def _inject_all(self, plan, ok: list[bool]) -> None:
        for layer in range(len(self.layers)):
            self._inject(layer, plan, ok)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def wait_layer(self, layer_name: str) -> None:
        if self.load is None or layer_name in self.injected:
            return
        if not self.load_ok:
            self.load_ok = self.load.result()
        self._inject(self.layers.index(layer_name), self.load_plan, self.load_ok)
        self.injected.add(layer_name)
        if len(self.injected) == len(self.layers):
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.load, self.load_plan, self.load_ok = None, [], []

    def _abandon_load(self) -> None:
        """A load whose layers were not all waited for (vLLM skipped the
        per-layer hook): what was not injected is reported for recompute."""
        if self.load is not None:
            ok = self.load_ok or self.load.result()
            if len(self.injected) < len(self.layers):
                missed = {t.block_ids[i] for (i, t), good in zip(self.load_plan, ok) if good}
                logger.warning("kvtier: %d loaded blocks were never waited for; vLLM recomputes them", len(missed))
                with self.lock:
                    self.load_errors.update(missed)
        self.load, self.load_plan, self.load_ok = None, [], []
        self.injected.clear()

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors_now, self.load_errors = self.load_errors, set()
        return errors_now

    # Saves.

    def _save_plan(self, saves: list[BlockTransfer]) -> list[tuple[int, BlockTransfer]]:
        return [(i, t) for t in saves for i in range(len(t.keys))] if self.saves_enabled else []

    def _copy_out(self, layer: int, plan) -> None:
        cache = self.caches[self.layers[layer]]
        ids = self._index([t.block_ids[i] for i, t in plan])
        dest = self.staging[layer, : len(plan)]
        if self.device.type == "cuda":
            dest.copy_(cache.index_select(0, ids), non_blocking=True)
        else:
            torch.index_select(cache, 0, ids, out=dest)

    def save_layer(self, layer_name: str, saves: list[BlockTransfer]) -> None:
        plan = self._save_plan(saves)
        if not plan or len(plan) > self.slots or layer_name in self.save_copied:
            return
        # This layer's KV for the step is written: copy it out now.
        self._copy_out(self.layers.index(layer_name), plan)
        self.save_copied.add(layer_name)
        if len(self.save_copied) == len(self.layers):
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.save = self.executor.submit(self._store, plan)

    def _store(self, plan) -> None:
        keys = [t.keys[i] for i, t in plan]
        ptrs, sizes = self._segments(len(plan))
        try:
            codes = self.client.batch_put_from_multi_buffers(keys, ptrs, sizes, skip_existing=True)
        except KvtierError as e:
            codes = [errors.IO] * len(keys)
            logger.warning("kvtier: saving %d blocks failed: %s", len(keys), e)
        stored = sum(1 for c in codes if c == errors.OK)
        with self.lock:
            self.counters["saved_blocks"] += stored
            self.counters["saved_bytes"] += stored * self.layer_bytes * len(self.layers)
            self.counters["save_errors"] += len(codes) - stored
        if stored != len(codes):
            logger.warning("kvtier: %d of %d blocks not saved (codes %s)", len(codes) - stored, len(codes), sorted(set(codes)))

    def finish_saves(self, saves: list[BlockTransfer]) -> None:
        self._abandon_load()
        plan = self._save_plan(saves)
        try:
            if self.save is not None:
                self.save.result()
            elif plan:
                # Layers not copied as they completed (more blocks than the
                # staging area holds, or no per-layer call): chunk by chunk.
                for start in range(0, len(plan), self.slots):
                    chunk = plan[start:start + self.slots]
                    for layer in range(len(self.layers)):
                        self._copy_out(layer, chunk)
                    if self.device.type == "cuda":
                        torch.cuda.current_stream().synchronize()
                    self._store(chunk)
        finally:
            self.save = None
            self.save_copied.clear()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        if self.client is not None:
            self.client.close()


def _size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if value.endswith(unit):
            return int(float(value[: -len(unit)]) * factor)
    return int(value)
