"""The vLLM connector at the scheduler level: vLLM's real Scheduler,
Request and allocate_kv_cache, with a stand-in for the model's forward pass
that writes each block's KV as a function of its block hash, so every load
is checked byte for byte against what that block must hold."""

import copy
import os
import socket

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
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.vllm import KvtierConnector, connector_namespace  # noqa: E402

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


def make_config(model_path: str, url: str, dtype: str = "float32", batched_tokens: int = 64) -> VllmConfig:
    model = ModelConfig(model=model_path, dtype=dtype, skip_tokenizer_init=True, max_model_len=1024)
    transfer = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config={"kvtier_url": url},
    )
    # The scheduler and the KV tensors live on the CPU here; naming the
    # device lets the official (CUDA) wheel build its config without a GPU.
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BS), device_config=DeviceConfig(device="cpu"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=8,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=transfer,
    )
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


class Harness:
    """A scheduler and a worker-side connector over real KV tensors."""

    def __init__(self, config: VllmConfig, num_blocks: int = 64):
        model = config.model_config
        self.spec = FullAttentionSpec(block_size=BS, num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                                      head_size=model.get_head_size(), dtype=model.dtype)
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(config.parallel_config))]
        kv_config = get_kv_cache_configs(config, [{name: self.spec for name in self.layers}],
                                         [num_blocks * self.spec.page_size_bytes * len(self.layers)])[0]
        config.cache_config.num_gpu_blocks = kv_config.num_blocks
        self.caches = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        self.scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                                   structured_output_manager=StructuredOutputManager(config), block_size=BS,
                                   log_stats=True)
        self.worker = KvtierConnector(config, KVConnectorRole.WORKER, kv_config)
        self.worker.register_kv_caches(self.caches)
        self.hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(self.hash_fn)
        self.before_load = None  # a hook run between schedule() and the loads
        self.invalid_reports: list[set[int]] = []
        # Per request: tokens counted as computed when first scheduled
        # (vLLM's local hit plus kvtier's).
        self.first_computed: dict[str, int] = {}

    @property
    def connector(self) -> KvtierConnector:
        return self.scheduler.connector

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Request:
        request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=get_request_block_hasher(BS, self.hash_fn))
        self.scheduler.add_request(request)
        return request

    def truth(self, block_hash: bytes, layer: int) -> torch.Tensor:
        """What a block's KV must be: a function of its hash (its prefix)."""
        seed = int.from_bytes(bytes(block_hash)[:7], "little") ^ layer
        shape = self.caches[self.layers[0]].shape[1:]
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=self.spec.dtype)

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
            # (schedule() has already counted them as computed).
            for req_id, n in out.num_scheduled_tokens.items():
                request = requests[req_id]
                done_before = (request.num_computed_tokens - n) // BS
                done_after = min(request.num_computed_tokens, request.num_tokens) // BS
                block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
                for j in range(done_before, min(done_after, len(request.block_hashes))):
                    self.caches[name][block_ids[j]] = self.truth(request.block_hashes[j], i)
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        invalid = w.get_block_ids_with_load_errors()
        if invalid:
            self.invalid_reports.append(invalid)
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = requests[req_id]
            sampled.append([7] if request.num_computed_tokens >= request.num_tokens else [])
        result = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(invalid_block_ids=invalid),
        )
        self.scheduler.update_from_output(out, result)
        self.verify()
        return out

    def verify(self) -> None:
        """Every block vLLM counts as computed holds that block's KV."""
        for req_id, request in self.scheduler.requests.items():
            if request.is_finished():
                continue
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            full = min(request.num_computed_tokens // BS, len(request.block_hashes), len(block_ids))
            for j in range(full):
                for i, name in enumerate(self.layers):
                    assert torch.equal(self.caches[name][block_ids[j]], self.truth(request.block_hashes[j], i)), (
                        f"{req_id} block {j} layer {i} holds the wrong KV"
                    )

    def run_all(self, limit: int = 200) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1009 + i * 37) % 500 + 1 for i in range(n)]


@pytest.fixture
def harness(kvtier_server, tiny_llama):
    h = Harness(make_config(tiny_llama, kvtier_server.url))
    yield h
    h.worker.shutdown()
    h.connector.shutdown()


def test_full_and_partial_prefix_hits_with_chunked_prefill(harness, kvtier_server):
    a = prompt(1, 200)
    harness.add("a", a)
    harness.run_all()  # 200 tokens in 64-token chunks: saved as blocks fill
    assert kvtier_server.op("batch_put_shm_segments")["keys"] == 6
    assert harness.scheduler.reset_prefix_cache()

    # Full hit: 6 blocks from kvtier, the last 8 tokens computed.
    harness.add("b", list(a))
    out = harness.step()
    assert harness.first_computed["b"] == 192
    loads = out.kv_connector_metadata.loads
    assert [len(t.keys) for t in loads] == [6]
    harness.run_all()
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
    assert out.scheduled_cached_reqs.resumed_req_ids or out.scheduled_new_reqs
    assert sum(len(t.keys) for t in out.kv_connector_metadata.loads) > 0
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
        loads = out.kv_connector_metadata.loads
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


def test_finished_requests_leave_no_state(harness):
    for k in range(3):
        harness.add(f"r{k}", prompt(10 + k, 150))
    harness.run_all()
    side = harness.connector._scheduler
    assert side.tracked == {} and side.allocated == {}
    worker = harness.worker._worker
    assert worker.load is None and not worker.load_plan and not worker.save_copied


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
    assert h.connector.get_num_new_matched_tokens(request, 0) == (192, False)
    assert other.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    for x in (h, other):
        x.worker.shutdown()
        x.connector.shutdown()
