"""The SGLang HiCache backend with SGLang's real factory and host pools
(MHA page_first and layer_first, MLA), against a real `kvtier serve`."""

import ctypes
import hashlib
import uuid

import pytest
import torch

import kvtier
from sglang_pools import PAGE, backend, in_another_process, page_bytes, tokens

LAYOUTS = [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first"), ("mla", "layer_first")]


def fill(pool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator, dtype=pool.kv_buffer.dtype))


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_set_then_get_into_other_pages_returns_the_same_bytes(kvtier_server, kind, layout):
    storage, pool = backend(kind, layout, kvtier_server.url)
    assert type(storage).__name__ == "KvtierHiCacheStorage"
    fill(pool, 1)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(8)]
    source = [1, 2, 3, 5, 8, 13, 21, 34]
    target = [40, 41, 42, 43, 50, 51, 52, 53]
    assert storage.batch_set_v1(keys, tokens(source)) == [True] * 8
    # A page's value is its segments in the order SGLang's pool lists them.
    ptrs, sizes = pool.get_page_buffer_meta(tokens([source[3]]))
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        assert client.get(keys[3]) == b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
    before = pool.kv_buffer.clone()
    assert storage.batch_get_v1(keys, tokens(target)) == [True] * 8
    assert page_bytes(pool, target) == page_bytes(pool, source)
    # Nothing outside the target pages was touched.
    dim = list(pool.kv_buffer.shape).index(pool.size)
    others = [t for t in range(pool.size) if t // PAGE not in target]
    index = torch.tensor(others)
    assert torch.equal(pool.kv_buffer.index_select(dim, index), before.index_select(dim, index))
    # batch_exists counts the leading pages present.
    assert storage.batch_exists(keys) == 8
    assert storage.batch_exists(keys[:5] + ["absent-" + uuid.uuid4().hex] + keys[5:]) == 5
    assert storage.batch_exists(["absent-" + uuid.uuid4().hex] + keys) == 0
    # Every byte went through shared memory.
    assert kvtier_server.op("batch_put")["requests"] == 0
    assert kvtier_server.op("batch_get_shm_segments")["keys"] >= 8


def test_a_missing_page_is_reported_and_its_memory_left_alone(kvtier_server):
    storage, pool = backend("mha", "layer_first", kvtier_server.url)
    fill(pool, 2)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(4)]
    assert storage.batch_set_v1(keys, tokens([0, 1, 2, 3])) == [True] * 4
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        assert client.remove(keys[2]) == 0
    marker = page_bytes(pool, [12])
    assert storage.batch_get_v1(keys, tokens([10, 11, 12, 13])) == [True, True, False, True]
    assert page_bytes(pool, [12]) == marker
    assert page_bytes(pool, [10, 11, 13]) == page_bytes(pool, [0, 1, 3])


def test_chunks_larger_than_the_staging_area(kvtier_server):
    # Room for 3 pages of staging each way (the area is split between sets
    # and gets): 10 pages go in 4 rounds each way.
    probe, _ = backend("mha", "page_first", kvtier_server.url)
    storage, pool = backend("mha", "page_first", kvtier_server.url, staging_size=6 * probe.page_bytes)
    assert storage.pages_per_batch == 3
    fill(pool, 3)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(10)]
    assert storage.batch_set_v1(keys, tokens(list(range(10)))) == [True] * 10
    assert storage.batch_get_v1(keys, tokens(list(range(20, 30)))) == [True] * 10
    assert page_bytes(pool, list(range(20, 30))) == page_bytes(pool, list(range(10)))


@pytest.mark.parametrize("kind,layout", [("mha", "layer_first"), ("mla", "page_first")])
def test_another_process_reads_what_one_backend_wrote(kvtier_server, kind, layout):
    storage, pool = backend(kind, layout, kvtier_server.url)
    fill(pool, 4)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(6)]
    pages = [2, 4, 6, 8, 10, 12]
    assert storage.batch_set_v1(keys, tokens(pages)) == [True] * 6
    args = {"kind": kind, "layout": layout, "url": kvtier_server.url, "keys": keys, "pages": [30, 31, 32, 33, 34, 35]}
    if kind == "mla":
        # Another tensor-parallel rank: MLA ranks share one namespace.
        args.update(tp_rank=1, tp_size=2)
    result = in_another_process(args)
    assert result["ok"] == [True] * 6
    assert result["exists"] == 6
    assert result["sha256"] == hashlib.sha256(page_bytes(pool, pages)).hexdigest()


def test_mla_ranks_other_than_the_writer_do_not_write(kvtier_server):
    reader, pool = backend("mla", "page_first", kvtier_server.url, tp_rank=1, tp_size=2)
    fill(pool, 5)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(2)]
    assert reader.batch_set_v1(keys, tokens([0, 1])) == [True, True]
    assert reader.batch_exists(keys) == 0


def test_namespaces_separate_layouts_and_tensor_parallel_ranks(kvtier_server):
    names = {
        backend("mha", "page_first", kvtier_server.url)[0].namespace,
        backend("mha", "layer_first", kvtier_server.url)[0].namespace,
        backend("mha", "page_first", kvtier_server.url, tp_rank=1, tp_size=2)[0].namespace,
        backend("mla", "page_first", kvtier_server.url)[0].namespace,
    }
    assert len(names) == 4


def test_the_namespace_names_the_model_by_its_weights_behind_the_prefix(kvtier_server, tiny_llama, tmp_path):
    """SGLang names the model by a path too: the namespace follows the
    weights' content (a copy elsewhere shares it, weights rewritten in
    place do not) and a deployment's prefix goes in front."""
    import shutil

    from conftest import write_tiny_llama

    model = tmp_path / "llama"
    shutil.copytree(tiny_llama, model)
    base = backend("mha", "page_first", kvtier_server.url, model=str(model))[0].namespace
    copy = tmp_path / "other-host" / "renamed"
    shutil.copytree(model, copy)
    assert backend("mha", "page_first", kvtier_server.url, model=str(copy))[0].namespace == base
    assert str(tmp_path) not in base and "sglang/llama/" in base, base
    prefixed = backend("mha", "page_first", kvtier_server.url, model=str(model), namespace_prefix="team-a")[0]
    assert prefixed.namespace.startswith("team-a/sglang/"), prefixed.namespace
    write_tiny_llama(model, seed=77)
    assert backend("mha", "page_first", kvtier_server.url, model=str(model))[0].namespace != base
    with pytest.raises(ValueError, match="model_fingerprint"):
        backend("mha", "page_first", kvtier_server.url, model=str(tmp_path / "absent"))


def test_a_page_that_fails_to_load_is_not_offered_again_until_it_is_stored_again(kvtier_server):
    """A value of the wrong size under a page's key: the load fails once,
    the lookup then stops before that page (no repeated failed loads), and
    the next store of the page replaces the wrong value."""
    storage, pool = backend("mha", "layer_first", kvtier_server.url)
    fill(pool, 3)
    keys = [f"{uuid.uuid4().hex}-{i}" for i in range(4)]
    assert storage.batch_set_v1(keys, tokens([0, 1, 2, 3])) == [True] * 4
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        assert client.put(keys[2], b"\x05" * 100) == 0
        assert storage.batch_exists(keys) == 4
        assert storage.batch_get_v1(keys, tokens([10, 11, 12, 13])) == [True, True, False, True]
        assert storage.batch_exists(keys) == 2, "a page that failed to load was offered again"
        # SGLang computes the page again and stores it: the wrong value goes.
        assert storage.batch_set_v1(keys[2:3], tokens([2])) == [True]
        assert len(client.get(keys[2])) == len(client.get(keys[0]))
    assert storage.batch_exists(keys) == 4
    assert storage.batch_get_v1(keys, tokens([20, 21, 22, 23])) == [True] * 4
    assert page_bytes(pool, [20, 21, 22, 23]) == page_bytes(pool, [0, 1, 2, 3])
    stats = storage.get_stats()
    assert stats["failed_pages_replaced"] == 1 and stats["failed_pages_held_back"] == 0, stats
