"""A vLLM KV connector backed by ``kvtier serve``.

Load it by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvtier_url": "unix:///run/kvtier/kvtier.sock"}}'

How it works (``docs/integrations.md`` has the whole story):

- Keys are vLLM's own block hashes (``request.block_hashes``: they already
  cover the tokens, the cache salt, LoRA and multimodal inputs), stored in a
  namespace naming the model by its fingerprint (weights and resolved
  configuration, never its path), the KV dtype, block size, parallel rank
  and the value layout, so blocks of incompatible engines never meet. A hybrid
  model (several KV cache groups: full attention beside sliding-window
  attention or a Mamba-style state) gets one value per block per group,
  the group's index in front of the hash and every group's geometry in the
  namespace.
- One value per block per rank (per group): the block's KV of every layer
  of the group, in the logical ``[H, N, C]`` order of vLLM's per-layer view
  (the raw page for state layers, which have no such view), layer after
  layer. The worker copies blocks between vLLM's KV cache and a staging area
  in kvtier's shared memory (one memcpy on CPU; a device-to-host DMA into
  CUDA-registered shared memory on GPU), and the server gathers or scatters
  the layers itself (multi-buffer calls), so no other copy is made.
- The scheduler asks the store how many leading tokens beyond vLLM's local
  hit it can restore in every group (``prefix_len`` for full attention; for
  a sliding window only the blocks inside the window of the hit's end, for
  a state group only the block at the hit's end, as vLLM's own prefix cache
  decides). By default loads are **asynchronous**: vLLM parks the request
  while a background thread fills its blocks, across as many steps as it
  takes, and reports it through ``get_finished``; ``"async_loads": false``
  loads inside the step instead (one batch, waited for per layer). Every
  newly filled prompt block is saved once its layers are computed. A block
  that fails to load (evicted meanwhile, corrupt on disk: kvtier verifies
  every read, of the wrong size, the server gone) is reported to vLLM, which
  recomputes it with ``kv_load_failure_policy = "recompute"``; its memory is
  never filled with unverified bytes. The request never looks up again, the
  block is offered to no request until this engine stores it again (the
  store replaces the failed value), and what an in-step load's step computed
  over unfilled blocks is never saved: a failure costs one recompute.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from .. import KvtierError, errors
from ._common import FailedKeys, connect, model_label, namespace_for, namespace_prefix, put_replacing, resolve_url
from ._fingerprint import model_fingerprint

try:  # vLLM >= 0.32: failures of a whole asynchronous load, by request.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM: per-block reports only
    KVConnectorTransferResults = None

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
# vLLM's block pool hands out block 0 as its null block: the placeholder a
# sliding-window or state group keeps where a block left the window. Nothing
# is ever loaded into it or saved from it.
NULL_BLOCK_ID = 0
# Keys whose load failed, remembered until stored again (the oldest are
# forgotten past this many: one more failed load each, then remembered).
SUSPECT_KEYS = 1 << 16


@dataclass
class BlockTransfer:
    """Blocks of one request to move: ``keys[i]`` <-> ``block_ids[i]`` of KV
    cache group ``groups[i]`` (an index into the connector's groups)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    groups: list[int] = field(default_factory=list)
    # A block the hit needs has no real block to go to: fail the whole load.
    broken: bool = False
    # Saves: replace what the store holds under these keys (a load of them
    # failed: the stored value is wrong, missing or unreadable).
    overwrite: bool = False

    def group(self, i: int) -> int:
        return self.groups[i] if self.groups else 0


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group as kvtier stores it."""

    index: int  # vLLM's KV cache group id
    kind: str  # "full", "window" or "state"
    block_size: int  # tokens per block of this group
    stride: int  # hash blocks (``request.block_hashes`` entries) per block
    window_blocks: int  # blocks a sliding-window hit needs (window kind)
    prefix: bytes  # in front of every key: b"" with one group
    layers: tuple[str, ...]
    describe: str  # what changes the group's bytes, for the namespace

    def key(self, hashes, block: int) -> bytes:
        # A chained hash names its whole prefix: the last hash block inside
        # this group's block names the block.
        return self.prefix + bytes(hashes[(block + 1) * self.stride - 1])

    def blocks_of(self, hashes) -> int:
        return len(hashes) // self.stride


def cache_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> list[CacheGroup]:
    """The groups a hit must restore: vLLM's prefix-cacheable transfer
    groups (one full-attention group for a plain model)."""
    block_size = vllm_config.cache_config.block_size
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    hash_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
    if len(groups) <= 1:
        # A plain model: keys and namespace as kvtier has always stored
        # them, layers in the order vLLM registers them.
        spec = groups[0].kv_cache_spec if groups else None
        size = getattr(spec, "block_size", block_size)
        kind, window = _kind(spec, size) if spec is not None else ("full", 0)
        return [CacheGroup(0, kind, size, _stride(0, size, hash_size), window, b"", (), "")]
    wanted = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if wanted is None:
        wanted = tuple(range(len(groups)))
    out = []
    for index in wanted:
        spec = groups[index].kv_cache_spec
        size = spec.block_size
        kind, window = _kind(spec, size)
        layers = tuple(groups[index].layer_names)
        describe = (
            f"{type(spec).__name__}:{kind}:{size}:{getattr(spec, 'sliding_window', '')}:"
            f"{spec.page_size_bytes}:{','.join(layers)}"
        )
        out.append(CacheGroup(index, kind, size, _stride(index, size, hash_size), window, bytes([index]), layers,
                              describe))
    return out


def _stride(index: int, size: int, hash_size: int) -> int:
    if size % hash_size:
        raise ValueError(
            f"kvtier: KV cache group {index} has {size}-token blocks, not a multiple of vLLM's "
            f"{hash_size}-token block hashes"
        )
    return size // hash_size


def _kind(spec: Any, block_size: int) -> tuple[str, int]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    per_layer = getattr(spec, "kv_cache_specs", None)
    if per_layer:
        # One kind of cache with layers of different shapes.
        spec = next(iter(per_layer.values()))
    if isinstance(spec, SlidingWindowSpec):
        # The blocks holding the window's last ``sliding_window - 1`` tokens
        # before the hit's end: what vLLM's sliding-window cache needs.
        return "window", max(1, math.ceil((spec.sliding_window - 1) / block_size))
    if isinstance(spec, MambaSpec):
        if getattr(spec, "mamba_cache_mode", "align") == "none":
            raise ValueError(
                "kvtier: a Mamba-style state group without prefix caching (mamba_cache_mode 'none') "
                "keeps no per-block states to store; enable vLLM's prefix caching (mamba_cache_mode 'align')"
            )
        # The state after the hit's last block lives in that block.
        return "state", 0
    if isinstance(spec, FullAttentionSpec):
        return "full", 0
    raise ValueError(
        f"kvtier: KV cache group of kind {type(spec).__name__} is not supported (full attention, "
        "sliding-window attention and Mamba-style state groups are)"
    )


def _parallel_layout(vllm_config: VllmConfig) -> tuple[int, int, bool]:
    parallel = vllm_config.parallel_config
    return parallel.tensor_parallel_size, parallel.pipeline_parallel_size, vllm_config.model_config.use_mla


def resolved_model_config(vllm_config: VllmConfig) -> dict[str, Any]:
    """What the engine computes KV with, beyond the weights: the model's
    configuration after ``hf_overrides`` and every other override, its
    numerics and quantization (``docs/integrations.md`` lists each field
    and why it is here)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf = model.hf_config
    fields = {
        "hf_config": hf.to_dict() if hasattr(hf, "to_dict") else vars(hf),
        "dtype": str(model.dtype),
        "quantization": getattr(model, "quantization", None),
        "override_attention_dtype": getattr(model, "override_attention_dtype", None),
        "kv_cache_dtype": cache.cache_dtype,
        "calculate_kv_scales": getattr(cache, "calculate_kv_scales", None),
    }
    return fields


def connector_namespace(
    vllm_config: VllmConfig,
    tp_rank: int,
    pp_rank: int,
    groups: list[CacheGroup] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """The namespace of one rank's blocks: everything that changes their
    bytes or meaning, the model by its fingerprint (weights and resolved
    configuration, never its path), behind the deployment's
    ``namespace_prefix``. MLA caches are the same on every TP rank, so they
    share one namespace (and rank 0 writes it). A hybrid model's namespace
    names every group's kind, geometry and layers."""
    extra = extra if extra is not None else (
        getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
    )
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    tp, pp, mla = _parallel_layout(vllm_config)
    dtype = str(model.dtype).removeprefix("torch.") if cache.cache_dtype == "auto" else cache.cache_dtype
    rank = f"pp{pp_rank}of{pp}-" + ("mla" if mla else f"tp{tp_rank}of{tp}")
    dcp = getattr(parallel, "decode_context_parallel_size", 1) or 1
    fields = {
        "label": model_label(model.hf_config),
        "fingerprint": model_fingerprint(
            model.model, getattr(model, "revision", None), resolved_model_config(vllm_config),
            extra.get("model_fingerprint"), engine="vLLM",
        ),
        "dtype": dtype,
        "block_size": cache.block_size,
        "rank": rank,
        "dcp": dcp,
        "layers": model.get_num_layers(parallel),
        "kv_heads": model.get_num_kv_heads(parallel),
        "head_size": model.get_head_size(),
        "mla": mla,
        "value_layout": "layers x logical [H, N, C] of the per-layer view",
    }
    if groups is not None and any(g.prefix for g in groups):
        fields["groups"] = [g.describe for g in groups]
        fields["value_layout"] = "per group: layers x logical [H, N, C] view, or the raw page of a viewless layer"
        fields["kv_cache_layout"] = str(getattr(cache, "kv_cache_layout", ""))
    return namespace_for("vllm", fields, namespace_prefix(extra.get("namespace_prefix")))


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
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
        groups = cache_groups(vllm_config, kv_cache_config)
        async_loads = _flag(extra.get("async_loads", True))
        hybrid = any(g.prefix for g in groups)
        if hybrid and not async_loads:
            # vLLM takes per-block load failures of one group only; a hybrid
            # model's failed load is reported for the whole request, which
            # only an asynchronous load can do.
            logger.warning("kvtier: a hybrid model loads asynchronously; async_loads=false is ignored")
            async_loads = True
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
            self._scheduler = _SchedulerSide(vllm_config, self._url, extra, groups, async_loads)
        else:
            self._worker = _WorkerSide(vllm_config, kv_cache_config, self._url, extra, groups, async_loads)

    def update_connector_output(self, connector_output) -> None:
        if self._scheduler is not None:
            finished = getattr(connector_output, "finished_recving", None) or set()
            self._scheduler.note_load_results(
                set(finished),
                set(getattr(connector_output, "failed_recving", None) or ()),
                set(getattr(connector_output, "invalid_block_ids", None) or ()),
            )
            self._scheduler.costs.loads_finished(finished)

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        matched = self._scheduler.matched_tokens(request, num_computed_tokens)
        return matched, self._scheduler.async_loads and matched > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves finish inside their step, and vLLM keeps the blocks of a
        # request whose load is in flight until the load is reported: no
        # block outlives the request on kvtier's account.
        if self._scheduler is not None:
            self._scheduler.forget(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

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
        self._worker.start_async_loads(meta.async_loads)
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done, _failed = self._worker.take_finished_loads()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        if self._worker is None or KVConnectorTransferResults is None:
            return super().get_transfer_results(finished_req_ids)
        done, failed = self._worker.take_finished_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

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


class LoadCosts:
    """Whether loading a hit would take longer than computing it, from what
    this engine measured: seconds per block of its asynchronous loads (from
    the step that starts one to the step that hears it finished) and tokens
    per second of its prefill steps. A slow tier (a shared file system over
    a slow link, a busy disk) or a small model can make a hit slower than
    recompute; such hits are skipped (``slow_hits_skipped``), except one in
    ``PROBE_EVERY``, which keeps the load estimate current."""

    ALPHA = 0.2  # weight of a new measurement
    MIN_SAMPLES = 3
    PROBE_EVERY = 16
    PREFILL_STEP_TOKENS = 64  # steps smaller than this are decode steps

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.block_s: float | None = None
        self.token_s: float | None = None
        self.load_samples = 0
        self.step_samples = 0
        self.skipped = 0
        self.started: dict[str, tuple[float, int]] = {}
        self.last_step: tuple[float, int] | None = None

    @classmethod
    def _mix(cls, old: float | None, new: float) -> float:
        return new if old is None else (1 - cls.ALPHA) * old + cls.ALPHA * new

    def step(self, scheduled_tokens: int, loads: list[tuple[str, int]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.last_step is not None:
            then, tokens = self.last_step
            if tokens >= self.PREFILL_STEP_TOKENS and now > then:
                self.token_s = self._mix(self.token_s, (now - then) / tokens)
                self.step_samples += 1
        self.last_step = (now, scheduled_tokens) if scheduled_tokens else None
        for req_id, blocks in loads:
            if blocks:
                self.started[req_id] = (now, blocks)

    def loads_finished(self, req_ids, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for req_id in req_ids:
            started = self.started.pop(req_id, None)
            if started is not None:
                self.block_s = self._mix(self.block_s, (now - started[0]) / started[1])
                self.load_samples += 1

    def slower_than_recompute(self, tokens: int, blocks: int) -> bool:
        if not self.enabled or self.load_samples < self.MIN_SAMPLES or self.step_samples < self.MIN_SAMPLES:
            return False
        if blocks * self.block_s <= tokens * self.token_s:
            return False
        self.skipped += 1
        return self.skipped % self.PROBE_EVERY != 0

    def forget(self, req_id: str) -> None:
        self.started.pop(req_id, None)


@dataclass
class _Tracked:
    """Scheduler-side state of a running request."""

    request: Request
    # Per group (in the connector's group order): the request's block ids,
    # and how many leading blocks are known to be stored or already saved.
    block_ids: list[list[int]]
    saved_blocks: list[int]


class _SchedulerSide:
    def __init__(
        self, vllm_config: VllmConfig, url: str, extra: dict[str, Any], groups: list[CacheGroup], async_loads: bool
    ):
        self.groups = groups
        self.async_loads = async_loads
        self.save_decode_blocks = _flag(extra.get("save_decode_blocks", False))
        # A hit ends where every group's blocks end.
        self.align = math.lcm(*(g.block_size for g in groups))
        self.hash_size = groups[0].block_size // groups[0].stride
        tp, pp, mla = _parallel_layout(vllm_config)
        tp_ranks = [0] if mla else list(range(tp))
        # A block is usable only if every rank has its part.
        self.clients = [
            connect(url, connector_namespace(vllm_config, t, p, groups)) for p in range(pp) for t in tp_ranks
        ]
        # Per request: the local hit a lookup was made for (tokens), until
        # its blocks are allocated.
        self.looked_up: dict[str, int] = {}
        # Requests allocated since the last step: external tokens, and the
        # synchronous load planned for them.
        self.allocated: dict[str, tuple[Request, int]] = {}
        self.sync_loads: list[BlockTransfer] = []
        self.async_pending: list[BlockTransfer] = []
        # Requests whose asynchronous load was planned: tokens it covers.
        self.loading: dict[str, int] = {}
        self.tracked: dict[str, _Tracked] = {}
        # Requests a load failed for (a block, or the whole load of a
        # hybrid model): they recompute, never look up again.
        self.load_failed: set[str] = set()
        # Loads planned and not yet reported: per request, the plan and the
        # step it was handed to the worker in (None while not yet handed).
        self.planned: dict[str, tuple[BlockTransfer, int | None]] = {}
        self.steps = 0
        # Keys a load of failed (wrong size, corrupt, missing, no server),
        # oldest first: offered to no request until this engine stores the
        # block again (replacing the stored value).
        self.suspect = FailedKeys(SUSPECT_KEYS)
        self.counters = {"lookups": 0, "lookup_errors": 0, "hit_tokens": 0, "async_loads": 0, "slow_hits_skipped": 0,
                         "failed_load_blocks": 0, "failed_load_requests": 0, "suspect_keys_replaced": 0}
        self.costs = LoadCosts(enabled=self.async_loads and _flag(extra.get("skip_slow_loads", True)))

    # Lookup.

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        self.looked_up.pop(request.request_id, None)
        if request.request_id in self.load_failed:
            # Its load failed as a whole: recompute rather than try again.
            return 0
        hashes = request.block_hashes
        # At least one token must be left for vLLM to compute.
        limit = min(len(hashes) * self.hash_size, request.num_tokens - 1)
        high = limit // self.align * self.align
        if high <= num_computed_tokens or any(num_computed_tokens % g.block_size for g in self.groups):
            return 0
        self.counters["lookups"] += 1
        try:
            hit = self._longest_hit(hashes, num_computed_tokens, high)
        except KvtierError as e:
            self.counters["lookup_errors"] += 1
            logger.warning("kvtier: lookup failed, treating as a miss: %s", e)
            return 0
        matched = max(0, hit - num_computed_tokens)
        if matched and self.costs.slower_than_recompute(matched, self._blocks_to_load(num_computed_tokens, hit)):
            self.counters["slow_hits_skipped"] += 1
            return 0
        if matched:
            self.looked_up[request.request_id] = num_computed_tokens
        self.counters["hit_tokens"] += matched
        return matched

    def note_load_results(self, finished: set[str], failed: set[str], invalid_blocks: set[int]) -> None:
        """A step's load results: requests whose asynchronous load
        finished, those whose whole load failed, and the blocks that failed
        to load. Every failed block's key becomes suspect and its request
        never looks up again, so a failure costs one recompute, never a
        loop of loads that fail the same way."""
        for req_id, (plan, step) in list(self.planned.items()):
            whole = req_id in failed
            bad = [n for n, block in enumerate(plan.block_ids) if whole or block in invalid_blocks]
            if bad:
                if req_id not in self.load_failed:
                    self.counters["failed_load_requests"] += 1
                self.load_failed.add(req_id)
                self.counters["failed_load_blocks"] += len(bad)
                self.suspect.add(plan.keys[n] for n in bad)
                tracked = self.tracked.get(req_id)
                if tracked is not None:
                    # A synchronous load: the request is running and
                    # recomputes from the first failed block; save again
                    # what it recomputes.
                    for n in bad:
                        gi = plan.group(n)
                        ids = tracked.block_ids[gi]
                        if plan.block_ids[n] in ids:
                            tracked.saved_blocks[gi] = min(tracked.saved_blocks[gi], ids.index(plan.block_ids[n]))
                logger.warning("kvtier: request %s: %d block(s) failed to load; it recomputes them and they are "
                               "offered to no request until stored again", req_id, len(bad))
            # An asynchronous load is over when its request is reported; an
            # in-step load's blocks are reported in its step's output (two
            # outputs allow for vLLM's asynchronous scheduling).
            if req_id in finished or whole or (step is not None and self.steps - step >= 2 and not self.async_loads):
                del self.planned[req_id]

    def _longest_hit(self, hashes, computed: int, high: int) -> int:
        """The longest prefix (tokens, a multiple of every group's block)
        every group can restore: full-attention groups need every block past
        the local hit, a sliding window the blocks inside the window before
        the hit's end, a state group the block at the hit's end."""
        bound = high
        for g in self.groups:
            if g.kind != "full":
                continue
            first = computed // g.block_size
            keys = self.suspect.cut([g.key(hashes, j) for j in range(first, bound // g.block_size)])
            if len(keys) < bound // g.block_size - first:
                bound = min(bound, (first + len(keys)) * g.block_size)
            if keys:
                n = min(c.prefix_len(keys) for c in self.clients)
                bound = min(bound, (first + n) * g.block_size)
        bound = bound // self.align * self.align
        if bound <= computed:
            return computed
        present: dict[int, tuple[int, list[bool]]] = {}
        for g in self.groups:
            if g.kind == "full":
                continue
            first = computed // g.block_size
            keys = [g.key(hashes, j) for j in range(first, bound // g.block_size)]
            answers = [c.batch_is_exist(keys) for c in self.clients]
            failed = self.suspect.known(keys)
            present[g.index] = (first, [all(a[j] == 1 for a in answers) and not failed[j] for j in range(len(keys))])
        end = bound
        while end > computed:
            if all(self._restorable(g, present, end) for g in self.groups if g.kind != "full"):
                return end
            end -= self.align
        return computed

    def _blocks_to_load(self, start: int, end: int) -> int:
        count = 0
        for g in self.groups:
            lo, hi = start // g.block_size, end // g.block_size
            count += min(hi - lo, g.window_blocks) if g.kind == "window" else 1 if g.kind == "state" else hi - lo
        return count

    @staticmethod
    def _restorable(g: CacheGroup, present: dict[int, tuple[int, list[bool]]], end_tokens: int) -> bool:
        first, bits = present[g.index]
        end = end_tokens // g.block_size
        # Blocks before the local hit are in vLLM's own cache already.
        start = max(first, end - g.window_blocks) if g.kind == "window" else end - 1
        return all(bits[j - first] for j in range(start, end))

    def _load_plan(self, request: Request, block_ids: tuple[list[int], ...], start: int, end: int) -> BlockTransfer:
        """What a hit of tokens ``[start, end)`` loads, group by group."""
        transfer = BlockTransfer(request.request_id, [], [], [])
        hashes = request.block_hashes
        for gi, g in enumerate(self.groups):
            ids = block_ids[g.index]
            lo, hi = start // g.block_size, end // g.block_size
            if g.kind == "window":
                lo = max(lo, hi - g.window_blocks)
            elif g.kind == "state":
                lo = hi - 1
            for j in range(lo, hi):
                if j >= len(ids) or ids[j] == NULL_BLOCK_ID:
                    logger.error("kvtier: request %s has no block for group %d block %d; recomputing it",
                                 request.request_id, g.index, j)
                    transfer.broken = True
                    continue
                transfer.keys.append(g.key(hashes, j))
                transfer.block_ids.append(ids[j])
                transfer.groups.append(gi)
        return transfer

    # Allocation and the per-step plan.

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        computed = self.looked_up.pop(req_id, None)
        if num_external_tokens <= 0 or computed is None:
            # Nothing to load (or a request's second call, once its
            # asynchronous load is in).
            self.allocated[req_id] = (request, 0)
            return
        plan = self._load_plan(request, blocks.get_block_ids(), computed, computed + num_external_tokens)
        self.planned[req_id] = (plan, None)
        if self.async_loads:
            self.async_pending.append(plan)
            self.loading[req_id] = computed + num_external_tokens
            self.counters["async_loads"] += 1
        else:
            self.sync_loads.append(plan)
            self.allocated[req_id] = (request, num_external_tokens)

    def build_meta(self, out: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self.sync_loads, async_loads=self.async_pending)
        self.sync_loads, self.async_pending = [], []
        self.steps += 1
        for t in meta.loads + meta.async_loads:
            if t.req_id in self.planned:
                self.planned[t.req_id] = (self.planned[t.req_id][0], self.steps)
        self.costs.step(sum(out.num_scheduled_tokens.values()), [(t.req_id, len(t.keys)) for t in meta.async_loads])
        for new in out.scheduled_new_reqs:
            request, external = self.allocated.pop(new.req_id, (None, 0))
            if request is None:
                continue
            tracked = self._track(new.req_id, request, new.block_ids, new.num_computed_tokens, external)
            self._add_save(meta, tracked, new.num_computed_tokens + out.num_scheduled_tokens.get(new.req_id, 0))
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
                previous = tracked.saved_blocks if tracked else None
                tracked = self._track(req_id, request, new_ids or (), computed, external)
                if previous is not None:
                    tracked.saved_blocks = [max(a, b) for a, b in zip(previous, tracked.saved_blocks)]
            elif tracked is None:
                continue
            elif new_ids is not None:
                for gi, g in enumerate(self.groups):
                    tracked.block_ids[gi].extend(new_ids[g.index])
            self._add_save(meta, tracked, computed + out.num_scheduled_tokens.get(req_id, 0))
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        return meta

    def _track(self, req_id: str, request: Request, block_ids, computed: int, external: int) -> _Tracked:
        # Blocks loaded from the store need no save; vLLM's own prefix hits
        # may not be in the store, so those are offered again (the server
        # skips what it has).
        loaded = self.loading.pop(req_id, None) is not None
        known = computed if (external or loaded) else 0
        tracked = _Tracked(
            request,
            [list(block_ids[g.index]) if len(block_ids) > g.index else [] for g in self.groups],
            [known // g.block_size for g in self.groups],
        )
        self.tracked[req_id] = tracked
        return tracked

    def _add_save(self, meta, tracked: _Tracked, computed_after_step: int) -> None:
        request = tracked.request
        hashes = request.block_hashes
        limit = request.num_tokens if self.save_decode_blocks else request.num_prompt_tokens
        done_tokens = min(computed_after_step, limit)
        transfer = BlockTransfer(request.request_id, [], [], [])
        replace = BlockTransfer(request.request_id, [], [], [], overwrite=True)
        for gi, g in enumerate(self.groups):
            ids = tracked.block_ids[gi]
            done = min(done_tokens // g.block_size, g.blocks_of(hashes), len(ids))
            start = tracked.saved_blocks[gi]
            if done <= start:
                continue
            if g.kind == "state":
                # Only the state at the step's end exists (in its block),
                # and only if the step ends on a block boundary.
                blocks = [done - 1] if computed_after_step == done * g.block_size else []
            else:
                blocks = range(start, done)
            for j in blocks:
                if ids[j] != NULL_BLOCK_ID:
                    key = g.key(hashes, j)
                    into = transfer
                    if self.suspect.take([key])[0]:
                        # Computed here: it replaces the value that failed.
                        self.counters["suspect_keys_replaced"] = self.suspect.replaced
                        into = replace
                    into.keys.append(key)
                    into.block_ids.append(ids[j])
                    into.groups.append(gi)
            tracked.saved_blocks[gi] = done
        meta.saves.extend(t for t in (transfer, replace) if t.keys)

    def forget(self, req_id: str) -> None:
        self.tracked.pop(req_id, None)
        self.allocated.pop(req_id, None)
        self.looked_up.pop(req_id, None)
        self.loading.pop(req_id, None)
        self.load_failed.discard(req_id)
        self.planned.pop(req_id, None)
        self.costs.forget(req_id)

    def close(self) -> None:
        for c in self.clients:
            c.close()


@dataclass
class _Segment:
    """One tensor of one layer, whose ``tensor[block]`` is a block's part."""

    layer: str
    tensor: torch.Tensor
    nbytes: int  # bytes per block


class _Staging:
    """A region of kvtier shared memory blocks pass through, laid out per
    group as ``[segment][slot][segment bytes]`` (so one layer's blocks are
    contiguous, for one copy per layer)."""

    def __init__(self, buffer, offset: int, size: int, groups: list[list[_Segment]]):
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
        self.base = buffer.ptr + offset
        share = size // len(groups)
        self.slots: list[int] = []
        self.offsets: list[list[int]] = []  # per group, per segment: offset in the region
        self.views: list[list[torch.Tensor]] = []
        cursor = 0
        for segments in groups:
            unit = sum(_align(s.nbytes) for s in segments)
            slots = share // unit
            if slots == 0:
                raise ValueError(
                    f"kvtier: staging_size {size} is too small: one block of a group is {unit} bytes "
                    f"and {len(groups)} group(s) share the staging area"
                )
            self.slots.append(slots)
            offsets, views = [], []
            for s in segments:
                length = _align(s.nbytes) * slots
                offsets.append(cursor)
                region = raw[offset + cursor: offset + cursor + s.nbytes * slots]
                views.append(region.view(s.tensor.dtype).view(slots, *s.tensor.shape[1:]))
                cursor += length
            self.offsets.append(offsets)
            self.views.append(views)

    def segments(self, group: int, slot: int, sizes: list[int]) -> tuple[list[int], list[int]]:
        return [self.base + off + slot * size for off, size in zip(self.offsets[group], sizes)], list(sizes)


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


class _WorkerSide:
    """Moves blocks between vLLM's KV cache and the store through staging
    areas of kvtier shared memory: one for saves and in-step loads, one for
    asynchronous loads (they run while the step's saves use the other)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig | None,
        url: str,
        extra: dict[str, Any],
        groups: list[CacheGroup],
        async_loads: bool,
    ):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.url = url
        self.groups = groups
        self.async_loads = async_loads
        self.hybrid = any(g.prefix for g in groups)
        # Regions start on cache lines (and on every dtype's alignment).
        self.staging_size = _size(extra.get("staging_size", DEFAULT_STAGING_SIZE)) // 64 * 64
        tp_rank = get_tensor_model_parallel_rank()
        pp_rank = get_pp_group().rank_in_group
        _, _, mla = _parallel_layout(vllm_config)
        self.namespace = connector_namespace(vllm_config, tp_rank, pp_rank, groups)
        # MLA ranks hold identical caches: one writes, all read.
        self.saves_enabled = not mla or tp_rank == 0
        self.client = None
        self.layers: list[str] = []
        self.counters = {
            "loaded_blocks": 0,
            "loaded_bytes": 0,
            "load_errors": 0,
            "saved_blocks": 0,
            "saved_bytes": 0,
            "save_errors": 0,
        }
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-transfer")
        self.load_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-load")
        self.load_errors: set[int] = set()
        self.lock = threading.Lock()
        # Asynchronous loads: in flight, and finished since vLLM last asked
        # (request id -> failed block ids).
        self.async_in_flight: set[str] = set()
        self.async_done: dict[str, set[int]] = {}
        # Fetched rounds waiting for the engine's thread to copy them in,
        # and the failed blocks of requests still loading.
        self.async_ready: list = []
        self.async_failed: dict[str, set[int]] = {}
        self.closing = False
        self.load_stream = None
        # This step's in-step load: its future, what it moved, which layers are in.
        self.load: Future | None = None
        self.load_plan: list[tuple[int, BlockTransfer]] = []
        self.load_ok: list[bool] = []
        self.injected: set[str] = set()
        # Requests whose in-step load failed in this step: the step computes
        # their later tokens over blocks that were never filled, so nothing
        # it saves for them is right (they are saved after the recompute).
        self.step_failed_requests: set[str] = set()
        self.save: Future | None = None
        self.save_copied: set[str] = set()

    # Layout.

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self.vllm_config.model_config
        first_tensor = next(iter(kv_caches.values()))
        self.device = first_tensor.device
        self.segments: list[list[_Segment]] = []  # per group
        self.layer_group: dict[str, int] = {}
        group_layers = [g.layers or tuple(kv_caches) for g in self.groups]
        for gi, names in enumerate(group_layers):
            segments = []
            for name in names:
                spec = self._spec(gi, name)
                cache = kv_caches.get(name)
                if cache is None:
                    raise ValueError(f"kvtier: vLLM registered no KV cache for layer {name}")
                view = self._layer_view(name, cache, spec)
                if not model.use_mla and getattr(spec, "num_kv_heads", None) is not None and view.dim() == 4:
                    expected = (spec.num_kv_heads, spec.block_size)
                    if tuple(view.shape[1:3]) != expected:
                        raise ValueError(
                            f"kvtier: layer {name} has shape {tuple(view.shape)}, not [blocks, {expected[0]}, "
                            f"{expected[1]}, content]: this vLLM's KV layout is not one kvtier knows"
                        )
                segments.append(_Segment(name, view, view[0].numel() * view.element_size()))
                self.layer_group[name] = gi
            first = segments[0]
            for s in segments:
                if not self.hybrid and (tuple(s.tensor.shape[1:]) != tuple(first.tensor.shape[1:])
                                        or s.tensor.dtype != first.tensor.dtype):
                    raise ValueError(f"kvtier: layer {s.layer} differs from layer {first.layer} in shape or dtype")
            self.segments.append(segments)
        self.layers = [s.layer for segments in self.segments for s in segments]
        self.sizes = [[s.nbytes for s in segments] for segments in self.segments]
        self.unit_bytes = [sum(sizes) for sizes in self.sizes]
        regions = 2 if self.async_loads else 1
        total = self.staging_size * regions
        self.client = connect(self.url, self.namespace, shm_size=total)
        self.staging_buffer = self.client.alloc_buffer(total)
        self.staging = _Staging(self.staging_buffer, 0, self.staging_size, self.segments)
        self.load_staging = (
            _Staging(self.staging_buffer, self.staging_size, self.staging_size, self.segments)
            if self.async_loads else None
        )
        if self.device.type == "cuda":
            # Device-to-host copies land straight in the memory the server reads.
            rc = torch.cuda.cudart().cudaHostRegister(self.staging_buffer.ptr, total, 0)
            if int(rc) != 0:
                raise RuntimeError(f"kvtier: cudaHostRegister of the staging buffer failed ({rc})")
            self.load_stream = torch.cuda.Stream(device=self.device)
        logger.info(
            "kvtier: %d group(s), %d layers, bytes per block %s, staging slots %s, %s loads, namespace %s",
            len(self.groups), len(self.layers), self.unit_bytes, self.staging.slots,
            "asynchronous" if self.async_loads else "in-step", self.namespace,
        )

    def _spec(self, gi: int, layer: str):
        groups = getattr(self.kv_cache_config, "kv_cache_groups", None) or []
        index = self.groups[gi].index
        spec = groups[index].kv_cache_spec if index < len(groups) else None
        per_layer = getattr(spec, "kv_cache_specs", None)
        return per_layer.get(layer, spec) if per_layer else spec

    def _layer_view(self, name: str, cache: torch.Tensor, spec) -> torch.Tensor:
        """A ``[blocks, ...]`` tensor whose ``[b]`` is layer ``name``'s part
        of block ``b``: vLLM's per-layer view, or for a layer without one
        (state layers get the raw backing buffer) its page in that buffer."""
        if isinstance(cache, torch.Tensor) and cache.dim() >= 2 and (
            spec is None or getattr(spec, "has_layer_views", True)
        ):
            return cache
        config = self.kv_cache_config
        for tensor in getattr(config, "kv_cache_tensors", None) or []:
            if name in tensor.layers and hasattr(tensor, "block_stride"):
                if not isinstance(cache, torch.Tensor) or cache.dim() != 1:
                    break
                page = getattr(spec, "real_page_size_bytes", None) or spec.page_size_bytes
                blocks = config.num_blocks_of(tensor) if hasattr(config, "num_blocks_of") else config.num_blocks
                start = cache.storage_offset() + tensor.offset + tensor.layers.index(name) * tensor.layer_stride
                return torch.as_strided(cache.view(torch.uint8), (blocks, page), (tensor.block_stride, 1), start)
        raise ValueError(
            f"kvtier: layer {name}: expected vLLM's per-layer [blocks, heads, tokens, content] KV tensor "
            f"or a raw state buffer with its placement, got {type(cache).__name__} {getattr(cache, 'shape', '')}"
        )

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    # Moving a batch of units (a group's block each) through a staging area.

    def _chunks(self, plan: list[tuple[int, BlockTransfer]], staging: _Staging):
        """The plan cut into batches that fit the staging area, each unit
        with its slot in its group's part."""
        used = [0] * len(self.groups)
        chunk: list[tuple[int, BlockTransfer, int]] = []
        for i, t in plan:
            g = t.group(i)
            if used[g] == staging.slots[g]:
                yield chunk
                used, chunk = [0] * len(self.groups), []
            chunk.append((i, t, used[g]))
            used[g] += 1
        if chunk:
            yield chunk

    def _pointers(self, chunk, staging: _Staging) -> tuple[list[list[int]], list[list[int]]]:
        ptrs, sizes = [], []
        for i, t, slot in chunk:
            g = t.group(i)
            p, s = staging.segments(g, slot, self.sizes[g])
            ptrs.append(p)
            sizes.append(s)
        return ptrs, sizes

    def _fetch(self, chunk, staging: _Staging) -> list[bool]:
        keys = [t.keys[i] for i, t, _ in chunk]
        ptrs, sizes = self._pointers(chunk, staging)
        try:
            got = self.client.batch_get_into_multi_buffers(keys, ptrs, sizes)
        except KvtierError as e:
            logger.warning("kvtier: load of %d blocks failed, vLLM recomputes them: %s", len(keys), e)
            got = [errors.IO] * len(keys)
        ok = [g == self.unit_bytes[t.group(i)] and not t.broken for g, (i, t, _) in zip(got, chunk)]
        good_bytes = sum(self.unit_bytes[t.group(i)] for good, (i, t, _) in zip(ok, chunk) if good)
        bad = len(ok) - sum(ok)
        with self.lock:
            self.counters["load_errors"] += bad
            self.counters["loaded_blocks"] += len(ok) - bad
            self.counters["loaded_bytes"] += good_bytes
        if bad:
            logger.warning("kvtier: %d of %d blocks missing or corrupt, vLLM recomputes them", bad, len(keys))
        return ok

    def _inject_segment(self, gi: int, k: int, chunk, ok: list[bool], staging: _Staging) -> None:
        picked = [(t.block_ids[i], slot) for good, (i, t, slot) in zip(ok, chunk) if good and t.group(i) == gi]
        if not picked:
            return
        tensor = self.segments[gi][k].tensor
        view = staging.views[gi][k]
        ids = self._index([b for b, _ in picked])
        slots = [s for _, s in picked]
        source = view[: len(slots)] if slots == list(range(len(slots))) else view[torch.tensor(slots)]
        tensor.index_copy_(0, ids, source.to(self.device, non_blocking=True))

    def _inject_layer(self, layer: str, chunk, ok, staging: _Staging) -> None:
        gi = self.layer_group[layer]
        for k, s in enumerate(self.segments[gi]):
            if s.layer == layer:
                self._inject_segment(gi, k, chunk, ok, staging)

    def _inject_all(self, chunk, ok, staging: _Staging) -> None:
        for gi, segments in enumerate(self.segments):
            for k in range(len(segments)):
                self._inject_segment(gi, k, chunk, ok, staging)

    def _copy_out_layer(self, layer: str, chunk, staging: _Staging) -> None:
        gi = self.layer_group[layer]
        picked = [(t.block_ids[i], slot) for i, t, slot in chunk if t.group(i) == gi]
        if not picked:
            return
        ids = self._index([b for b, _ in picked])
        for k, s in enumerate(self.segments[gi]):
            if s.layer != layer:
                continue
            # A chunk's units of one group take its slots 0..n-1 in order.
            dest = staging.views[gi][k][: len(picked)]
            if self.device.type == "cuda":
                dest.copy_(s.tensor.index_select(0, ids), non_blocking=True)
            else:
                torch.index_select(s.tensor, 0, ids, out=dest)

    # Asynchronous loads.

    def start_async_loads(self, loads: list[BlockTransfer]) -> None:
        for transfer in loads:
            with self.lock:
                if transfer.req_id in self.async_in_flight:
                    logger.error("kvtier: a second load for request %s while one is in flight", transfer.req_id)
                # Marked before the job can finish (and unmark it).
                self.async_in_flight.add(transfer.req_id)
            self.load_executor.submit(self._load_async, transfer)

    def _load_async(self, transfer: BlockTransfer) -> None:
        """The load thread's part: fetch each round of blocks into the load
        staging area (one call, the GIL released), hand it to the engine's
        thread, which copies it into vLLM's cache at its next
        ``get_finished``, and wait for that before the next round reuses the
        area. The engine's thread does the copies because it holds the GIL
        almost always: a thread of many short Python calls would wait for
        the GIL at each (5 ms a switch), which measured slower than the copy."""
        assert self.load_staging is not None
        plan = [(i, transfer) for i in range(len(transfer.keys))]
        chunks = list(self._chunks(plan, self.load_staging)) or [[]]
        for n, chunk in enumerate(chunks):
            try:
                ok = self._fetch(chunk, self.load_staging) if chunk else []
            except Exception:  # noqa: BLE001 - a failed load must still be reported, as failed
                logger.exception("kvtier: asynchronous load of request %s failed; vLLM recomputes it",
                                 transfer.req_id)
                ok = [False] * len(chunk)
            copied = threading.Event()
            with self.lock:
                self.async_ready.append((transfer, chunk, ok, n == len(chunks) - 1, copied))
            while not copied.wait(0.5):
                if self.closing:
                    return

    def _copy_in_ready(self) -> None:
        """On the engine's thread: copy fetched rounds into vLLM's cache and
        record finished requests (with the blocks that failed)."""
        with self.lock:
            ready, self.async_ready = self.async_ready, []
        for transfer, chunk, ok, last, copied in ready:
            failed = self.async_failed.setdefault(transfer.req_id, set())
            failed.update(t.block_ids[i] for good, (i, t, _) in zip(ok, chunk) if not good)
            try:
                if self.load_stream is not None:
                    with torch.cuda.stream(self.load_stream):
                        self._inject_all(chunk, ok, self.load_staging)
                    self.load_stream.synchronize()
                else:
                    self._inject_all(chunk, ok, self.load_staging)
            except Exception:  # noqa: BLE001 - reported as failed, recomputed
                logger.exception("kvtier: copying loaded blocks of request %s failed", transfer.req_id)
                failed.update(t.block_ids[i] for i, t, _ in chunk)
            copied.set()
            if last:
                if transfer.broken and not failed:
                    failed.update(transfer.block_ids or [NULL_BLOCK_ID])
                with self.lock:
                    self.async_done[transfer.req_id] = self.async_failed.pop(transfer.req_id)
                    self.async_in_flight.discard(transfer.req_id)

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load finished since the last call,
        and those of them that failed. A plain model's failed blocks go to
        ``take_load_errors`` now, so vLLM hears of them no later than of
        the request; a hybrid model's failure is the whole request's (vLLM
        cannot place a block id of several groups)."""
        self._copy_in_ready()
        with self.lock:
            done, self.async_done = self.async_done, {}
            failed = {r for r, bad in done.items() if bad}
            if not self.hybrid:
                for bad in done.values():
                    self.load_errors.update(bad)
                failed = set()
        return set(done), failed

    # In-step loads.

    def start_loads(self, loads: list[BlockTransfer]) -> None:
        self._abandon_load()
        self.step_failed_requests = set()
        plan = [(i, t) for t in loads for i in range(len(t.keys))]
        if not plan:
            return
        chunks = list(self._chunks(plan, self.staging))
        if len(chunks) == 1:
            # One batch, waited for by the first layer that needs it.
            self.load_plan = chunks[0]
            self.load = self.executor.submit(self._fetch, chunks[0], self.staging)
            return
        # More than the staging area holds: chunk by chunk, all layers each.
        self._wait_save()
        for chunk in chunks:
            ok = self._fetch(chunk, self.staging)
            self._report(chunk, ok)
            self._inject_all(chunk, ok, self.staging)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _report(self, chunk, ok: list[bool]) -> None:
        with self.lock:
            self.load_errors.update(t.block_ids[i] for good, (i, t, _) in zip(ok, chunk) if not good)
        self.step_failed_requests.update(t.req_id for good, (i, t, _) in zip(ok, chunk) if not good)

    def wait_layer(self, layer_name: str) -> None:
        if self.load is None or layer_name in self.injected:
            return
        if not self.load_ok:
            self.load_ok = self.load.result()
            self._report(self.load_plan, self.load_ok)
        if layer_name in self.layer_group:
            self._inject_layer(layer_name, self.load_plan, self.load_ok, self.staging)
            self.injected.add(layer_name)
        if len(self.injected) == len(self.layers):
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.load, self.load_plan, self.load_ok = None, [], []
            self.injected.clear()

    def _abandon_load(self) -> None:
        """An in-step load whose layers were not all waited for (vLLM
        skipped the per-layer hook): what was not injected is reported for
        recompute."""
        if self.load is not None:
            if not self.load_ok:
                self.load_ok = self.load.result()
                self._report(self.load_plan, self.load_ok)
            if len(self.injected) < len(self.layers):
                missed = {t.block_ids[i] for good, (i, t, _) in zip(self.load_ok, self.load_plan) if good}
                logger.warning("kvtier: %d loaded blocks were never waited for; vLLM recomputes them", len(missed))
                with self.lock:
                    self.load_errors.update(missed)
                self.step_failed_requests.update(t.req_id for _, t, _ in self.load_plan)
        self.load, self.load_plan, self.load_ok = None, [], []
        self.injected.clear()

    def take_load_errors(self) -> set[int]:
        with self.lock:
            errors_now, self.load_errors = self.load_errors, set()
        return errors_now

    # Saves.

    def _save_chunks(self, saves: list[BlockTransfer]) -> list:
        if not self.saves_enabled:
            return []
        if self.step_failed_requests:
            saves = [t for t in saves if t.req_id not in self.step_failed_requests]
        return list(self._chunks([(i, t) for t in saves for i in range(len(t.keys))], self.staging))

    def _wait_save(self) -> None:
        """The previous step's put reads the staging area: wait for it
        before writing there again."""
        if self.save is not None:
            save, self.save = self.save, None
            save.result()

    def save_layer(self, layer_name: str, saves: list[BlockTransfer]) -> None:
        if not saves or layer_name in self.save_copied or layer_name not in self.layer_group:
            return
        chunks = self._save_chunks(saves)
        if len(chunks) != 1:
            return
        self._wait_save()
        # This layer's KV for the step is written: copy it out now.
        self._copy_out_layer(layer_name, chunks[0], self.staging)
        self.save_copied.add(layer_name)
        if len(self.save_copied) == len(self.layers):
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            self.save = self.executor.submit(self._store, chunks[0])

    def _store(self, chunk) -> None:
        keys = [t.keys[i] for i, t, _ in chunk]
        ptrs, sizes = self._pointers(chunk, self.staging)
        try:
            # Blocks whose load failed replace the stored value; the others
            # leave what is stored (another engine's identical block).
            codes = put_replacing(self.client, keys, ptrs, sizes, [t.overwrite for _, t, _ in chunk])
        except KvtierError as e:
            codes = [errors.IO] * len(keys)
            logger.warning("kvtier: saving %d blocks failed: %s", len(keys), e)
        stored = [c == errors.OK for c in codes]
        with self.lock:
            self.counters["saved_blocks"] += sum(stored)
            self.counters["saved_bytes"] += sum(
                self.unit_bytes[t.group(i)] for good, (i, t, _) in zip(stored, chunk) if good
            )
            self.counters["save_errors"] += len(codes) - sum(stored)
        if not all(stored):
            logger.warning("kvtier: %d of %d blocks not saved (codes %s)", len(codes) - sum(stored), len(codes),
                           sorted(set(codes)))

    def finish_saves(self, saves: list[BlockTransfer]) -> None:
        """The step's end. A put started after the last layer keeps running
        into the next step (vLLM's cache is already copied out, so nothing
        it reads can change); the next use of the staging area waits for it."""
        self._abandon_load()
        try:
            chunks = self._save_chunks(saves)
            if self.save_copied and len(self.save_copied) == len(self.layers):
                pass  # this step's put is running
            elif len(chunks) == 1 and self.save_copied:
                self._wait_save()
                # Some layers took no per-layer call (state layers have
                # none): copy them now, then store.
                for layer in self.layers:
                    if layer not in self.save_copied:
                        self._copy_out_layer(layer, chunks[0], self.staging)
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                self._store(chunks[0])
            elif chunks:
                # Layers not copied as they completed (more blocks than the
                # staging area holds, or no per-layer call): chunk by chunk.
                self._wait_save()
                for chunk in chunks:
                    for layer in self.layers:
                        self._copy_out_layer(layer, chunk, self.staging)
                    if self.device.type == "cuda":
                        torch.cuda.current_stream().synchronize()
                    self._store(chunk)
        finally:
            self.save_copied.clear()

    def pending_loads(self) -> int:
        """Asynchronous loads in flight or not yet reported to vLLM."""
        with self.lock:
            return len(self.async_in_flight) + len(self.async_done)

    def close(self) -> None:
        self.closing = True
        with self.lock:
            for *_, copied in self.async_ready:
                copied.set()
        self.load_executor.shutdown(wait=True)
        self._wait_save()
        self.executor.shutdown(wait=True)
        if self.client is not None:
            self.client.close()


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _size(value: int | str) -> int:
    if isinstance(value, int):
        return value
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if value.endswith(unit):
            return int(float(value[: -len(unit)]) * factor)
    return int(value)
