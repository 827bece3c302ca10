"""kvtier as a secondary tier of vLLM's own KV offloading.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU
primary tier (one shared-memory region of all workers of an instance) and a
chain of secondary tiers that read and write that region in the scheduler
process. This module is such a tier, loaded by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KvtierSecondaryTier",
                "module_path": "kvtier.integrations.vllm_tier",
                "kvtier_url": "unix:///run/kvtier/kvtier.sock"}]}}'

One kvtier value per primary chunk (the chunk's bytes as the primary region
holds them: every worker's part of the chunk's blocks), under vLLM's offload
key (block hash and KV cache group), in a namespace naming the model (by
its fingerprint), dtype, chunk geometry and parallel layout. Every call is asynchronous: stores and
loads are kvtier's background batch calls straight between the primary
region and the server's socket (one copy on the host each way: the primary
region is a plain /dev/shm file, which kvtier does not register, because a
server must not map memory another process can truncate under it), and
lookups run on one thread, answering ``RETRY`` while a key is being looked
up. Nothing blocks the scheduler; a failed job is reported as failed (vLLM
then recomputes), and a load writes only bytes the server verified.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .. import KvtierError, errors
from ._common import FailedKeys, connect, model_label, namespace_for, read_config_json, resolve_url
from ._common import namespace_prefix as namespace_prefix_of
from ._fingerprint import model_fingerprint

logger = logging.getLogger("kvtier.vllm_tier")

# How long a lookup's answer is reused for the same key (the manager asks
# again for a key it got RETRY for, and for every request sharing a prefix).
DEFAULT_LOOKUP_TTL = 1.0
# Most keys the lookup thread asks the server about in one call, and most
# answers kept (older ones are dropped first).
LOOKUP_BATCH = 4096
MAX_REMEMBERED = 1 << 18


class _Job:
    __slots__ = ("job", "pending", "keys", "started", "bytes")

    def __init__(self, job: TransferJob, pending: Any, keys: list[bytes], nbytes: int):
        self.job = job
        self.pending = pending
        self.keys = keys
        self.started = time.monotonic()
        self.bytes = nbytes


class KvtierSecondaryTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` over a kvtier server."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        kvtier_url: str | None = None,
        lookup_ttl: float = DEFAULT_LOOKUP_TTL,
        model_fingerprint: str | None = None,
        namespace_prefix: str | None = None,
        locality: str | None = None,
        backpressure_detector: Any = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ValueError(
                f"kvtier tier: unknown configuration keys {sorted(unknown)} "
                "(known: kvtier_url, lookup_ttl, model_fingerprint, namespace_prefix)"
            )
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        view = primary_kv_view
        if view.ndim != 2 or not view.c_contiguous or view.readonly:
            raise ValueError("kvtier tier: the primary region must be a writable 2-D C-contiguous view")
        # Rows as slices of one flat byte view (a memoryview has no row
        # sub-views of its own).
        self._flat = view.cast("B")
        self._rows = view.shape[0]
        self._chunk = self.block_size_bytes
        self.lookup_ttl = float(lookup_ttl)
        self.namespace = self._namespace(offloading_spec, self._chunk, model_fingerprint, namespace_prefix)
        self.url = resolve_url(kvtier_url)
        self._client = connect(self.url, self.namespace)
        self._jobs: list[_Job] = []
        self._finished: list[JobResult] = []
        # Lookups: answers (present, when) and keys waiting for the thread.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._answers: dict[bytes, tuple[bool, float]] = {}
        self._asking: set[bytes] = set()
        self._queue: list[bytes] = []
        self._stopping = False
        self._lookups = threading.Thread(target=self._lookup_loop, name="kvtier-tier-lookup", daemon=True)
        self._lookups.start()
        self.counters = {"stored": 0, "store_failures": 0, "loaded": 0, "load_failures": 0, "lookup_errors": 0}
        # Chunks whose load failed: answered MISS until stored again.
        self._failed = FailedKeys()
        logger.info("kvtier tier: %d-byte chunks, namespace %s, server %s", self._chunk, self.namespace, self.url)

    @staticmethod
    def _namespace(spec: Any, chunk_bytes: int, pinned: str | None = None, prefix: str | None = None) -> str:
        config = spec.config
        parallel = config.parallel
        return namespace_for(
            "vllm-tier",
            {
                "label": model_label(read_config_json(config.model.name)),
                "fingerprint": model_fingerprint(config.model.name, None, _engine_config(config.model.name), pinned,
                                                 engine="vLLM tier"),
                "dtype": config.model.dtype,
                "rank": f"tp{parallel.tp_size}-pp{parallel.pp_size}",
                "chunk_bytes": chunk_bytes,
                "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
                "blocks_per_chunk": config.cache.blocks_per_chunk,
                "tokens_per_hash": config.cache.tokens_per_hash,
                "groups": [(g.group_id, g.tokens_per_block, list(g.layer_names)) for g in config.groups],
                "world_size": parallel.world_size,
                "pcp_dcp": (parallel.pcp_size, parallel.dcp_size),
                "layout": config.kv_cache_layout,
                "canonical": config.canonical_layout,
                "replicated": config.replicated_layout,
                "value_layout": "one primary chunk row",
            },
            namespace_prefix_of(prefix),
        )

    # Lookups: never block the scheduler.

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        key = bytes(key)
        now = time.monotonic()
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None and now - answer[1] < self.lookup_ttl:
                return LookupResult.HIT if answer[0] else LookupResult.MISS
            if key not in self._asking:
                self._asking.add(key)
                self._queue.append(key)
                self._wake.notify()
        return LookupResult.RETRY

    def _lookup_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
                keys, self._queue = self._queue[:LOOKUP_BATCH], self._queue[LOOKUP_BATCH:]
            try:
                found = [code == 1 and not bad
                         for code, bad in zip(self._client.batch_is_exist(keys), self._failed.known(keys))]
            except KvtierError as e:
                # The server is away: a miss (vLLM computes), asked again
                # after the answer's lifetime.
                logger.warning("kvtier tier: lookup of %d keys failed, treating them as misses: %s", len(keys), e)
                self.counters["lookup_errors"] += 1
                found = [False] * len(keys)
            now = time.monotonic()
            with self._lock:
                for key, present in zip(keys, found):
                    self._answers[key] = (present, now)
                    self._asking.discard(key)
                self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        if len(self._answers) <= MAX_REMEMBERED:
            return
        self._answers = {k: a for k, a in self._answers.items() if now - a[1] < self.lookup_ttl}
        while len(self._answers) > MAX_REMEMBERED:
            self._answers.pop(next(iter(self._answers)))

    def _remember(self, keys: Iterable[bytes], present: bool) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._answers[key] = (present, now)
            self._forget_old(now)

    # Transfers: kvtier's background batch calls on primary rows.

    def _views(self, job: TransferJob) -> list[memoryview]:
        out = []
        for chunk in job.chunk_ids:
            c = int(chunk)
            if not 0 <= c < self._rows:
                raise ValueError(f"kvtier tier: chunk {c} is outside the primary region ({self._rows} chunks)")
            out.append(self._flat[c * self._chunk:(c + 1) * self._chunk])
        return out

    def _submit(self, job: TransferJob, store: bool) -> None:
        keys = [bytes(k) for k in job.keys]
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"kvtier tier: job {job.job_id} has {len(keys)} keys for {len(job.chunk_ids)} chunks")
        try:
            views = self._views(job)
            if store:
                # A job holding a chunk whose load failed replaces what is
                # stored (the others' bytes are the same computation).
                replace = any(self._failed.take(keys))
                pending = self._client.batch_put_from_async(keys, views, skip_existing=not replace)
            else:
                pending = self._client.batch_get_into_async(keys, views)
        except (KvtierError, ValueError) as e:
            logger.warning("kvtier tier: job %d could not start: %s", job.job_id, e)
            self._finished.append(JobResult(job_id=job.job_id, success=False))
            self.counters["store_failures" if store else "load_failures"] += len(keys)
            return
        self._jobs.append(_Job(job, pending, keys, len(keys) * self._chunk))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def _collect(self, wait: bool) -> None:
        still: list[_Job] = []
        for entry in self._jobs:
            if not wait and not entry.pending.done():
                still.append(entry)
                continue
            try:
                codes = entry.pending.wait()
            except KvtierError as e:
                logger.warning("kvtier tier: job %d failed: %s", entry.job.job_id, e)
                codes = [errors.IO] * len(entry.keys)
            elapsed = time.monotonic() - entry.started
            if entry.job.is_promotion:
                ok = [code == self._chunk for code in codes]
                self.counters["loaded"] += sum(ok)
                self.counters["load_failures"] += len(ok) - sum(ok)
                if not all(ok):
                    bad = [k for k, good in zip(entry.keys, ok) if not good]
                    self._failed.add(bad)
                    self._remember(bad, False)
            else:
                ok = [code == errors.OK for code in codes]
                self.counters["stored"] += sum(ok)
                self.counters["store_failures"] += len(ok) - sum(ok)
                self._remember([k for k, good in zip(entry.keys, ok) if good], True)
            success = all(ok)
            self._finished.append(
                JobResult(
                    job_id=entry.job.job_id,
                    success=success,
                    successful_keys=None if success else [k for k, good in zip(entry.job.keys, ok) if good],
                    transfer_time=elapsed,
                    transfer_bytes=sum(ok) * self._chunk,
                )
            )
        self._jobs = still

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect(wait=False)
        done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._finished)

    def drain_jobs(self) -> None:
        self._collect(wait=True)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def shutdown(self) -> None:
        self.drain_jobs()
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        self._lookups.join(timeout=5)
        self._client.close()
        self._flat.release()

    def get_tier_stats(self) -> dict[str, int]:
        """kvtier's counters for this tier (chunks stored, loaded, failed)."""
        return dict(self.counters)


def _engine_config(model: str) -> dict[str, Any]:
    """The resolved configuration of the engine this tier serves: vLLM's
    own (after ``hf_overrides``) when the tier is built inside the engine's
    configuration context, as the offloading connector does; otherwise the
    model's ``config.json`` (overrides unseen: pin ``model_fingerprint``)."""
    try:
        from vllm.config import get_current_vllm_config

        from .vllm import resolved_model_config

        current = get_current_vllm_config()
        if current.model_config is not None and current.model_config.model == model:
            return resolved_model_config(current)
    except Exception as e:  # noqa: BLE001 - no context: fall back to the file
        logger.debug("kvtier tier: no current vLLM configuration (%s)", e)
    return {"config.json": read_config_json(model)}
