"""The vLLM connector at the scheduler level: vLLM's real Scheduler,
Request and allocate_kv_cache, with a stand-in for the model's forward pass
that writes each block's KV as a function of its block hash, so every load
is checked byte for byte against what that block must hold."""

import copy
import math
import os
import shutil
import socket
import threading
import time

import pytest
import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402

try:  # vLLM 0.33 moved the planner out of kv_cache_utils and made the groups explicit.
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.core.kv_cache_planning import get_kv_cache_configs as _configs

    def get_kv_cache_configs(config, specs, memory):
        return _configs(config, specs, memory, get_global_kv_cache_groups(config, specs))
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.vllm import KvtierConnector, LoadCosts, connector_namespace  # noqa: E402

BS = 32


@pytest.fixture(scope="module", autouse=True)
def distributed():
    """vLLM's process groups for a single worker (the connector asks for
    its tensor- and pipeline-parallel rank)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    yield


def make_config(model_path: str, url: str, dtype: str = "float32", batched_tokens: int = 64,
                async_loads: bool = True, hybrid: bool = False, block_size: int = BS, cache_dtype: str = "auto",
                hf_overrides: dict | None = None, extra: dict | None = None) -> VllmConfig:
    model = ModelConfig(model=model_path, dtype=dtype, skip_tokenizer_init=True, max_model_len=1024,
                        **({"hf_overrides": hf_overrides} if hf_overrides else {}))
    transfer = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        # The stand-in forward pass costs nothing like a model's: loads
        # must not be judged against it (test_load_costs covers the rule).
        kv_connector_extra_config={"kvtier_url": url, "async_loads": async_loads, "skip_slow_loads": False,
                                   **(extra or {})},
    )
    # The scheduler and the KV tensors live on the CPU here; naming the
    # device lets the official (CUDA) wheel build its config without a GPU.
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=8,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=transfer,
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    if hybrid:
        # vLLM keeps the hybrid manager on for connectors that declare
        # SupportsHMA on a GPU; this CPU build turns it off for every model,
        # so the scheduler-level tests turn it back on.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        config.cache_config.mamba_cache_mode = "align"
    return config


def attention_spec(config: VllmConfig, window: int | None = None):
    model = config.model_config
    shape = dict(block_size=BS, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                 head_size=model.get_head_size(), dtype=model.dtype)
    return SlidingWindowSpec(**shape, sliding_window=window) if window else FullAttentionSpec(**shape)


def state_spec(config: VllmConfig):
    """A Mamba-style state group: a conv and an SSM state per block, padded
    to the attention page as vLLM's hybrid allocator requires."""
    page = attention_spec(config).page_size_bytes
    return MambaSpec(block_size=BS, shapes=((3, 96), (4, 16, 32)), dtypes=(torch.float32, torch.float32),
                     page_size_padded=page, mamba_cache_mode="align")


class Harness:
    """A scheduler and a worker-side connector over real KV tensors."""

    def __init__(self, config: VllmConfig, num_blocks: int = 64, specs: dict | None = None):
        model = config.model_config
        if specs is None:
            specs = {f"model.layers.{i}.self_attn.attn": attention_spec(config)
                     for i in range(model.get_num_layers(config.parallel_config))}
        self.specs = specs
        self.layers = list(specs)
        page = max(s.page_size_bytes for s in specs.values())
        kv_config = get_kv_cache_configs(config, [specs], [num_blocks * page * len(self.layers)])[0]
        self.kv_config = kv_config
        config.cache_config.num_gpu_blocks = kv_config.num_blocks
        self.caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        # Per layer: its group, and a [blocks, ...] view whose [b] is its part of block b.
        self.group_of = {name: g for g, group in enumerate(kv_config.kv_cache_groups) for name in group.layer_names}
        self.views = {name: self._view(name) for name in self.layers}
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BS,
                                   log_stats=True)
        self.worker = KvtierConnector(config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(self.caches)
        self.hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(self.hash_fn)
        self.before_load = None  # a hook run between schedule() and the loads
        self.invalid_reports: list[set[int]] = []
        self.failed_reports: list[set[str]] = []
        # Per request: tokens counted as computed when first scheduled
        # (vLLM's local hit plus kvtier's).
        self.first_computed: dict[str, int] = {}

    def _view(self, name: str) -> torch.Tensor:
        cache = self.caches[name]
        if cache.dim() > 1:
            return cache
        # A state layer gets the raw buffer: its page of each block.
        tensor = next(t for t in self.kv_config.kv_cache_tensors if name in t.layers)
        spec = self.specs[name]
        return torch.as_strided(cache.view(torch.uint8), (self.kv_config.num_blocks, spec.real_page_size_bytes),
                                (tensor.block_stride, 1),
                                tensor.offset + tensor.layers.index(name) * tensor.layer_stride)

    def kind(self, name: str) -> str:
        spec = self.specs[name]
        return "state" if isinstance(spec, MambaSpec) else "window" if isinstance(spec, SlidingWindowSpec) else "full"

    @property
    def connector(self) -> KvtierConnector:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=get_request_block_hasher(BS, self.hash_fn))
        self.scheduler.add_request(request)
        return request

    def truth(self, block_hash: bytes, layer: int) -> torch.Tensor:
        """What a block's part of a layer must be: a function of its hash
        (its prefix)."""
        seed = int.from_bytes(bytes(block_hash)[:7], "little") ^ layer
        view = self.views[self.layers[layer]]
        generator = torch.Generator().manual_seed(seed)
        if view.dtype.is_floating_point:
            return torch.randn(view.shape[1:], generator=generator, dtype=view.dtype)
        shape = (*view.shape[1:-1], view.shape[-1] * view.element_size())
        return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).view(view.dtype)

    def block_ids(self, req_id: str, name: str) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)[self.group_of[name]]

    def step(self):
        out = self.scheduler.schedule()
        for new in out.scheduled_new_reqs:
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        if self.before_load is not None:
            self.before_load(out)
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        requests = self.scheduler.requests
        for i, name in enumerate(self.layers):
            w.wait_for_layer_load(name)
            # The forward pass: blocks completed by this step's tokens
            # (schedule() has already counted them as computed); a state
            # layer keeps only the state at the step's end, in its block
            # when the step ends on a block boundary (vLLM's "align" mode).
            for req_id, n in out.num_scheduled_tokens.items():
                request = requests[req_id]
                done_before = (request.num_computed_tokens - n) // BS
                computed = min(request.num_computed_tokens, request.num_tokens)
                done_after = min(computed // BS, len(request.block_hashes))
                ids = self.block_ids(req_id, name)
                start = request.num_computed_tokens - n
                if self.kind(name) == "state" and start and start % BS == 0 and start // BS <= len(ids):
                    # The step starts from the state at its first token: it
                    # must be the one of the prefix before it.
                    j = start // BS - 1
                    assert torch.equal(self.views[name][ids[j]], self.truth(request.block_hashes[j], i)), (
                        f"{req_id} starts from a wrong state in {name} (block {j})"
                    )
                if self.kind(name) == "state":
                    blocks = [done_after - 1] if computed % BS == 0 and done_after > done_before else []
                else:
                    blocks = range(done_before, done_after)
                for j in blocks:
                    assert ids[j] != 0, f"{req_id} block {j} of {name} is the null block"
                    self.views[name][ids[j]] = self.truth(request.block_hashes[j], i)
            if self.kind(name) != "state":  # state layers have no per-layer hook in vLLM
                w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        if invalid:
            self.invalid_reports.append(invalid)
        if results.failed_recving:
            self.failed_reports.append(set(results.failed_recving))
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = requests[req_id]
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        result = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving, failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
            ),
        )
        self.scheduler.update_from_output(out, result)
        self.verify()
        if not req_ids:
            time.sleep(0.002)  # only loads in flight: let them run
        return out

    def verify(self) -> None:
        """Every block vLLM counts as computed, and will read, holds that
        block's KV: every block of full attention, the blocks inside the
        window of a sliding window, the block at the end of a state group."""
        for req_id, request in self.scheduler.requests.items():
            if request.is_finished() or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            computed = request.num_computed_tokens
            for i, name in enumerate(self.layers):
                ids = self.block_ids(req_id, name)
                full = min(computed // BS, len(request.block_hashes), len(ids))
                kind = self.kind(name)
                if kind == "state":
                    # The state vLLM resumes from is the one at the last
                    # block boundary it counts as computed.
                    blocks = [full - 1] if full and computed % BS == 0 and request.num_output_tokens == 0 else []
                elif kind == "window":
                    window = math.ceil((self.specs[name].sliding_window - 1) / BS)
                    blocks = range(max(0, full - window), full)
                else:
                    blocks = range(full)
                for j in blocks:
                    assert torch.equal(self.views[name][ids[j]], self.truth(request.block_hashes[j], i)), (
                        f"{req_id} block {j} layer {name} holds the wrong KV"
                    )

    def run_all(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def loads_of(self, out) -> list:
        meta = out.kv_connector_metadata
        return meta.loads + meta.async_loads

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1009 + i * 37) % 500 + 1 for i in range(n)]


@pytest.fixture(params=["async", "sync"])
def harness(request, kvtier_server, tiny_llama):
    h = Harness(make_config(tiny_llama, kvtier_server.url, async_loads=request.param == "async"))
    yield h
    h.shutdown()


def test_full_and_partial_prefix_hits_with_chunked_prefill(harness, kvtier_server):
    a = prompt(1, 200)
    harness.add("a", a)
    harness.run_all()  # 200 tokens in 64-token chunks: saved as blocks fill
    assert kvtier_server.op("batch_put_shm_segments")["keys"] == 6
    assert harness.scheduler.reset_prefix_cache()

    # Full hit: 6 blocks from kvtier, the last 8 tokens computed.
    harness.add("b", list(a))
    out = harness.step()
    assert [len(t.keys) for t in harness.loads_of(out)] == [6]
    harness.run_all()
    assert harness.first_computed["b"] == 192
    assert kvtier_server.op("batch_get_shm_segments")["keys"] == 6
    assert harness.scheduler.reset_prefix_cache()

    # Partial hit: the first 4 blocks shared, then different tokens; a
    # request shorter than one block beyond its hit leaves a token to compute.
    c = a[:128] + prompt(2, 100)
    harness.add("c", c)
    harness.add("d", a[:96])  # exactly 3 blocks: only 2 may load
    harness.run_all()
    assert harness.first_computed["c"] == 128
    assert harness.first_computed["d"] == 64
    assert not harness.invalid_reports


def test_preemption_and_resume_reload_from_kvtier(harness):
    harness.add("p", prompt(3, 300), max_tokens=4)
    harness.add("q", prompt(4, 300), max_tokens=4)
    for _ in range(6):
        harness.step()
    computed = {r: harness.scheduler.requests[r].num_computed_tokens for r in ("p", "q")}
    assert any(c >= BS for c in computed.values()), computed
    # Preempt everything and drop vLLM's own cache: resuming must load.
    assert harness.scheduler.reset_prefix_cache(reset_running_requests=True)
    out = harness.step()
    assert sum(len(t.keys) for t in harness.loads_of(out)) > 0
    harness.run_all()
    assert not harness.invalid_reports


def test_a_block_gone_before_its_load_is_recomputed_not_used(harness, kvtier_server):
    a = prompt(5, 200)
    harness.add("a", a)
    harness.run_all()
    assert harness.scheduler.reset_prefix_cache()
    namespace = connector_namespace(harness.scheduler.vllm_config, 0, 0)
    victim = {}

    def remove_block_two(out):
        loads = harness.loads_of(out)
        if loads and not victim:
            victim["key"], victim["block"] = loads[0].keys[2], loads[0].block_ids[2]
            with kvtier.Client(kvtier_server.url, namespace=namespace) as client:
                assert client.remove(victim["key"]) == 0
            # Garbage where the block goes: a load that used it would show.
            for name in harness.layers:
                harness.caches[name][victim["block"]] = float("nan")

    harness.before_load = remove_block_two
    harness.add("b", list(a))
    harness.run_all()
    assert harness.invalid_reports == [{victim["block"]}]
    assert harness.worker.stats()["load_errors"] == 1
    if harness.worker._worker.async_loads:
        # Scheduled once the load is in: blocks before the failed one
        # loaded, the rest recomputed.
        assert harness.first_computed["b"] == 64


def test_a_wrong_value_is_loaded_once_then_replaced_never_offered_in_a_loop(harness, kvtier_server):
    """Every stored block of a prompt overwritten with a value of the wrong
    size (shorter, longer) or removed: the next request's load fails once
    per block, it recomputes and finishes, nobody is offered those blocks
    again until the recompute stores them (replacing the wrong values),
    and then they hit with the right bytes."""
    a = prompt(8, 200)
    harness.add("a", a)
    harness.run_all()
    assert harness.scheduler.reset_prefix_cache()
    namespace = connector_namespace(harness.scheduler.vllm_config, 0, 0)
    keys = []
    harness.before_load = lambda out: keys.extend(k for t in harness.loads_of(out) for k in t.keys)
    with kvtier.Client(kvtier_server.url, namespace=namespace) as client:
        probe = Request("probe", a, SamplingParams(max_tokens=1), None,
                        block_hasher=get_request_block_hasher(BS, harness.hash_fn))
        names = [bytes(h) for h in probe.block_hashes[:6]]
        size = len(client.get(names[0]))
        for n, name in enumerate(names):
            if n == 5:
                assert client.remove(name) == 0
            else:
                assert client.put(name, b"\x01" * (size // 2 if n % 2 else size + 4096)) == 0

        harness.add("b", list(a))
        harness.run_all(limit=200)  # the old connector looped here for ever (async loads)
        # One load of the five blocks found, each failed once, then recompute.
        assert len(keys) == 5 and set(keys) == set(names[:5]), len(keys)
        assert sum(len(r) for r in harness.invalid_reports) == 5
        counters = harness.connector.stats()
        assert counters["failed_load_blocks"] == 5 and counters["failed_load_requests"] == 1, counters
        assert counters["suspect_keys_replaced"] == 5, counters
        # The recompute replaced the wrong values (and stored the removed one).
        assert all(len(client.get(name)) == size for name in names)

    keys.clear()
    assert harness.scheduler.reset_prefix_cache()
    harness.add("c", list(a))
    harness.run_all()
    assert len(keys) == 6 and harness.first_computed["c"] == 192, (keys, harness.first_computed)
    assert sum(len(r) for r in harness.invalid_reports) == 5  # nothing new failed; verify() checked the bytes


def test_a_server_killed_mid_load_costs_a_recompute_not_a_hang(harness, kvtier_server):
    a = prompt(9, 200)
    harness.add("a", a)
    harness.run_all()
    with kvtier.Client(kvtier_server.url) as client:
        client.flush()
    assert harness.scheduler.reset_prefix_cache()
    killed = []

    def kill_at_first_load(out):
        if harness.loads_of(out) and not killed:
            kvtier_server.kill()
            killed.append(True)

    harness.before_load = kill_at_first_load
    harness.add("b", list(a))
    harness.run_all(limit=400)
    assert killed and harness.invalid_reports
    assert harness.connector.stats()["failed_load_requests"] == 1
    # Back up: the blocks (flushed before the kill) hit again, verified by
    # verify() byte for byte.
    kvtier_server.start()
    harness.before_load = None
    assert harness.scheduler.reset_prefix_cache()
    harness.add("c", list(a))
    harness.run_all()
    assert harness.first_computed["c"] == 192, harness.first_computed


def test_finished_requests_leave_no_state(harness):
    for k in range(3):
        harness.add(f"r{k}", prompt(10 + k, 150))
    harness.run_all()
    assert harness.scheduler.reset_prefix_cache()
    for k in range(3):
        harness.add(f"again{k}", prompt(10 + k, 150))  # hits: loads, then saves nothing new
    harness.run_all()
    assert all(harness.first_computed[f"again{k}"] == 128 for k in range(3))
    side = harness.connector._scheduler
    assert side.tracked == {} and side.allocated == {} and side.loading == {} and side.looked_up == {}
    assert not side.sync_loads and not side.async_pending
    worker = harness.worker._worker
    assert worker.load is None and not worker.load_plan and not worker.save_copied
    assert worker.pending_loads() == 0


def test_an_async_load_spans_steps_while_others_compute_and_an_abort_mid_load_leaks_nothing(
    kvtier_server, tiny_llama
):
    h = Harness(make_config(tiny_llama, kvtier_server.url))
    free_at_start = h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    a = prompt(20, 200)
    h.add("a", a)
    h.run_all()
    assert h.scheduler.reset_prefix_cache()
    # Hold the load thread: the load is queued behind this until released.
    gate = threading.Event()
    worker = h.worker._worker
    worker.load_executor.submit(gate.wait)
    h.add("b", list(a))
    h.add("c", prompt(21, 150))  # nothing stored: computed meanwhile
    steps_waiting = 0
    for _ in range(20):
        h.step()
        if h.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            steps_waiting += 1
        if "c" not in h.scheduler.requests:
            break
    assert "c" not in h.scheduler.requests, "c did not finish while b's load was held"
    assert steps_waiting >= 3 and h.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    gate.set()
    h.run_all()
    assert h.first_computed["b"] == 192 and not h.invalid_reports

    # An abort while the load is in flight: vLLM keeps the blocks until the
    # load is reported, then frees them; nothing is left anywhere.
    assert h.scheduler.reset_prefix_cache()
    gate = threading.Event()
    worker.load_executor.submit(gate.wait)
    h.add("d", list(a))
    h.step()
    assert h.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    gate.set()
    for _ in range(200):
        h.step()
        if worker.pending_loads() == 0 and not h.scheduler.requests:
            break
    assert worker.pending_loads() == 0 and not h.scheduler.requests
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start
    assert h.connector._scheduler.loading == {} and h.connector._scheduler.tracked == {}
    h.shutdown()


def test_keys_differ_across_dtype_and_tensor_parallel_rank(kvtier_server, tiny_llama):
    f32 = make_config(tiny_llama, kvtier_server.url)
    bf16 = make_config(tiny_llama, kvtier_server.url, dtype="bfloat16")
    tp2 = copy.deepcopy(f32)
    tp2.parallel_config.tensor_parallel_size = 2
    names = {
        connector_namespace(f32, 0, 0),
        connector_namespace(bf16, 0, 0),
        connector_namespace(tp2, 0, 0),
        connector_namespace(tp2, 1, 0),
    }
    assert len(names) == 4
    assert all(len(n.encode()) <= 128 for n in names)

    # Blocks saved by a float32 engine are invisible to a bfloat16 one.
    h = Harness(f32)
    a = prompt(6, 200)
    h.add("a", a)
    h.run_all()
    other = Harness(bf16)
    request = Request("x", a, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BS, other.hash_fn))
    assert h.connector.get_num_new_matched_tokens(request, 0) == (192, True)
    assert other.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    for x in (h, other):
        x.shutdown()


# Hybrid models: several KV cache groups, as vLLM's own planner builds them.


def hybrid_harness(server, model: str, second: str) -> Harness:
    config = make_config(model, server.url, hybrid=True)
    other = attention_spec(config, window=64) if second == "window" else state_spec(config)
    specs = {"l0": attention_spec(config), "l1": other, "l2": attention_spec(config), "l3": other}
    h = Harness(config, num_blocks=96, specs=specs)
    groups = h.kv_config.kv_cache_groups
    assert [g.layer_names for g in groups] == [["l0", "l2"], ["l1", "l3"]], groups
    return h


def namespace_of(h: Harness) -> str:
    return connector_namespace(h.scheduler.vllm_config, 0, 0, h.connector._scheduler.groups)


def lookup(h: Harness, tokens: list[int]) -> int:
    request = Request("probe", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BS, h.hash_fn))
    hit, is_async = h.connector.get_num_new_matched_tokens(request, 0)
    h.connector._scheduler.looked_up.clear()
    assert is_async == (hit > 0)
    return hit


def group_key(h: Harness, tokens: list[int], group: int, block: int) -> bytes:
    request = Request("keys", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BS, h.hash_fn))
    return bytes([group]) + bytes(request.block_hashes[block])


def test_the_namespace_names_the_computation_never_the_path(kvtier_server, tiny_llama, tmp_path):
    """Every field that changes a block's bytes changes the namespace; the
    checkpoint's path does not (a copy elsewhere, another host's, hits)."""
    url = kvtier_server.url
    base = connector_namespace(make_config(tiny_llama, url), 0, 0)
    copy = tmp_path / "another-host" / "renamed"
    shutil.copytree(tiny_llama, copy)
    assert connector_namespace(make_config(str(copy), url), 0, 0) == base
    assert "tiny-llama" not in base and str(tmp_path) not in base, base

    changed = {
        "dtype": make_config(tiny_llama, url, dtype="bfloat16"),
        "kv_cache_dtype": make_config(tiny_llama, url, cache_dtype="fp8_e4m3"),
        "block_size": make_config(tiny_llama, url, block_size=16),
        "hf_overrides (numerics)": make_config(tiny_llama, url, hf_overrides={"rms_norm_eps": 0.5}),
        "hf_overrides (rope)": make_config(tiny_llama, url, hf_overrides={"rope_theta": 5000.0}),
        "pinned fingerprint": make_config(tiny_llama, url, extra={"model_fingerprint": "registry@sha256:1"}),
    }
    names = {field: connector_namespace(config, 0, 0) for field, config in changed.items()}
    for field, name in names.items():
        assert name != base, f"{field} does not change the namespace"
    assert len(set(names.values())) == len(names)
    # A pin names the weights wherever they are.
    assert connector_namespace(make_config(str(copy), url, extra={"model_fingerprint": "registry@sha256:1"}),
                               0, 0) == names["pinned fingerprint"]

    # One byte the fingerprint samples, rewritten in the copy: its own namespace.
    weights = copy / "model.safetensors"
    content = bytearray(weights.read_bytes())
    content[-1] ^= 0x01
    weights.write_bytes(bytes(content))
    assert connector_namespace(make_config(str(copy), url), 0, 0) != base

    # A deployment's prefix (a tenant's) goes in front, whole.
    prefixed = connector_namespace(make_config(tiny_llama, url, extra={"namespace_prefix": "team-a/prod"}), 0, 0)
    assert prefixed.startswith("team-a/prod/vllm/") and len(prefixed.encode()) <= 128, prefixed


def test_a_tenant_token_serves_an_engine_through_its_namespace_prefix(tmp_path, tiny_llama, monkeypatch):
    """A scoped tenant token is usable by an engine: the deployment puts
    its tenant prefix in front of the connector's namespace."""
    from conftest import KvtierServer

    token = "a" * 64
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nname = "team-a"\ntoken = "{token}"\nnamespaces = ["team-a"]\n')
    tenants.chmod(0o600)
    # The Unix socket (the connector's shared memory needs it), as the
    # server's own user: the tenant's token still holds it to the tenant.
    server = KvtierServer(tmp_path / "data", extra=["--tenants", str(tenants), "--auth-token", "s" * 64])
    try:
        monkeypatch.setenv("KVTIER_AUTH_TOKEN", token)
        with pytest.raises(RuntimeError, match="outside tenant team-a"):
            Harness(make_config(tiny_llama, server.url))
        h = Harness(make_config(tiny_llama, server.url, extra={"namespace_prefix": "team-a/prod"}))
        a = prompt(11, 200)
        h.add("a", a)
        h.run_all()
        assert h.scheduler.reset_prefix_cache()
        h.add("b", list(a))
        h.run_all()
        assert h.first_computed["b"] == 192
        h.shutdown()
    finally:
        server.stop()


def test_cache_salt_and_lora_isolate_blocks_through_vllms_own_hashes(harness):
    """What vLLM hashes into its block hashes, proven rather than trusted:
    a prompt stored under one cache salt (or LoRA adapter) is a miss under
    another, a hit under the same."""
    from vllm.lora.request import LoRARequest

    a = prompt(10, 200)

    def request(req_id, salt=None, lora=None):
        return Request(req_id, a, SamplingParams(max_tokens=2, ignore_eos=True), None, cache_salt=salt,
                       lora_request=lora, block_hasher=get_request_block_hasher(BS, harness.hash_fn))

    harness.scheduler.add_request(request("stored", salt="tenant-1"))
    harness.run_all()
    connector = harness.connector
    assert connector.get_num_new_matched_tokens(request("same", salt="tenant-1"), 0)[0] == 192
    assert connector.get_num_new_matched_tokens(request("other-salt", salt="tenant-2"), 0)[0] == 0
    assert connector.get_num_new_matched_tokens(request("no-salt"), 0)[0] == 0
    adapter = LoRARequest("adapter-a", 1, "/nonexistent/adapter-a")
    assert connector.get_num_new_matched_tokens(request("lora", salt="tenant-1", lora=adapter), 0)[0] == 0
    for req_id in ("same", "other-salt", "no-salt", "lora"):
        connector.request_finished(Request(req_id, a, SamplingParams(max_tokens=1), None), [])


def test_hybrid_sliding_window_loads_the_window_and_hits_as_far_as_every_group_can(kvtier_server, tiny_llama):
    h = hybrid_harness(kvtier_server, tiny_llama, "window")
    a = prompt(30, 200)
    h.add("a", a)
    h.run_all()
    # One value per block per group: 6 full-attention blocks, 6 window blocks.
    assert kvtier_server.op("batch_put_shm_segments")["keys"] == 12
    assert h.scheduler.reset_prefix_cache()
    h.add("b", list(a))
    out = h.step()
    (load,) = h.loads_of(out)
    # All 6 full-attention blocks; of the window group only the 2 blocks
    # inside the 64-token window before the hit's end.
    assert [load.groups.count(0), load.groups.count(1)] == [6, 2]
    h.run_all()
    assert h.first_computed["b"] == 192 and not h.failed_reports and not h.invalid_reports

    # Partial hits: a window block missing at the end shortens the hit to
    # where the window group has its blocks; a full-attention block missing
    # shortens it to before that block.
    namespace = namespace_of(h)
    with kvtier.Client(kvtier_server.url, namespace=namespace) as client:
        assert lookup(h, a) == 192
        assert client.remove(group_key(h, a, 1, 5)) == 0
        assert lookup(h, a) == 160  # window group: blocks 3, 4 for a hit ending at block 5
        assert client.remove(group_key(h, a, 1, 3)) == 0
        assert lookup(h, a) == 96  # blocks 1, 2 for a hit ending at block 3
        assert client.remove(group_key(h, a, 0, 1)) == 0
        assert lookup(h, a) == 32  # full attention stops at block 1; block 0 of both groups is there
    assert h.scheduler.reset_prefix_cache()
    h.add("c", list(a))
    h.run_all()
    assert h.first_computed["c"] == 32
    h.shutdown()


def test_hybrid_state_group_loads_the_state_at_the_hit_and_only_boundaries_that_hold_one(kvtier_server, tiny_llama):
    h = hybrid_harness(kvtier_server, tiny_llama, "state")
    a = prompt(31, 200)
    h.add("a", a)
    h.run_all()  # 64-token chunks: the state is kept at 64, 128 and 192 tokens
    assert kvtier_server.op("batch_put_shm_segments")["keys"] == 6 + 3
    assert h.scheduler.reset_prefix_cache()
    h.add("b", list(a))
    out = h.step()
    (load,) = h.loads_of(out)
    assert [load.groups.count(0), load.groups.count(1)] == [6, 1]
    h.run_all()
    assert h.first_computed["b"] == 192 and not h.failed_reports
    # A prompt sharing 5 blocks: no state was kept after block 5 (160
    # tokens), so the hit ends at the last state before it (128).
    assert lookup(h, a[:160] + prompt(32, 100)) == 128
    h.shutdown()


def test_hybrid_failed_load_recomputes_the_whole_request(kvtier_server, tiny_llama):
    h = hybrid_harness(kvtier_server, tiny_llama, "window")
    a = prompt(33, 200)
    h.add("a", a)
    h.run_all()
    assert h.scheduler.reset_prefix_cache()
    namespace = namespace_of(h)

    def remove_a_window_block(out):
        loads = h.loads_of(out)
        if loads and h.before_load is not None:
            h.before_load = None
            victim = loads[0].groups.index(1)
            with kvtier.Client(kvtier_server.url, namespace=namespace) as client:
                assert client.remove(loads[0].keys[victim]) == 0
            for name in ("l1", "l3"):
                h.views[name][loads[0].block_ids[victim]] = float("nan")

    h.before_load = remove_a_window_block
    h.add("b", list(a))
    h.run_all()
    # vLLM cannot place a block id of several groups: the request is
    # reported failed, recomputed from the start, and not looked up again.
    assert h.failed_reports == [{"b"}] and not h.invalid_reports
    assert h.first_computed["b"] == 0
    assert h.connector._scheduler.load_failed == set()
    h.shutdown()


def test_hybrid_keys_differ_across_groups_and_models(kvtier_server, tiny_llama):
    window = hybrid_harness(kvtier_server, tiny_llama, "window")
    state = hybrid_harness(kvtier_server, tiny_llama, "state")
    plain = Harness(make_config(tiny_llama, kvtier_server.url))
    names = {namespace_of(x) for x in (window, state, plain)}
    assert len(names) == 3
    a = prompt(34, 200)
    window.add("a", a)
    window.run_all()
    with kvtier.Client(kvtier_server.url, namespace=namespace_of(window)) as client:
        full = [group_key(window, a, 0, j) for j in range(6)]
        sliding = [group_key(window, a, 1, j) for j in range(6)]
        assert client.batch_is_exist(full) == [1] * 6 and client.batch_is_exist(sliding) == [1] * 6
        assert not set(full) & set(sliding)
    # The same prompt is a miss for another model layout and a plain model.
    assert lookup(state, a) == 0 and lookup(plain, a) == 0 and lookup(window, a) == 192
    for x in (window, state, plain):
        x.shutdown()


def test_load_costs_skip_a_hit_slower_than_recompute_but_probe_now_and_then():
    costs = LoadCosts(enabled=True)
    # No verdict before enough of both measurements.
    assert not costs.slower_than_recompute(tokens=320, blocks=10)
    t = 100.0
    for k in range(4):
        # Prefill steps of 256 tokens, 0.256 s each: 1 ms per token.
        costs.step(256, [(f"r{k}", 10)], now=t)
        t += 0.256
        # Loads of 10 blocks taking 0.5 s: 50 ms per block.
        costs.loads_finished([f"r{k}"], now=t + 0.244)
    costs.step(0, [], now=t)
    assert costs.load_samples == 4 and costs.step_samples >= 3
    assert math.isclose(costs.token_s, 0.001, rel_tol=1e-6)
    # 10 blocks (0.5 s) against 320 tokens (0.32 s): skipped, but one in
    # PROBE_EVERY is loaded anyway to keep the estimate current.
    verdicts = [costs.slower_than_recompute(tokens=320, blocks=10) for _ in range(LoadCosts.PROBE_EVERY)]
    assert verdicts.count(False) == 1 and verdicts[-1] is False
    # 1000 tokens (1 s) against the same load: loaded.
    assert not costs.slower_than_recompute(tokens=1000, blocks=10)
    assert not LoadCosts(enabled=False).slower_than_recompute(tokens=1, blocks=1000)
