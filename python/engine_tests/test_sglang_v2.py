"""SGLang HiCache interface v2 (hybrid models): the kvtier backend with
SGLang's real factory, real KV host pools (MHA, MLA) and real sidecar host
pools (sliding-window KV, a draft model's MLA pool, Mamba state), against a
real `kvtier serve`."""

import ctypes
import hashlib
import threading
import uuid

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

import kvtier
from sglang_pools import (fill_randomly, hybrid_backend, in_another_process, page_bytes, pool_page_bytes, tokens,
                          v2_transfers)

LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mla", "page_first"), ("mla", "layer_first")]


def keys_for(n: int) -> list[str]:
    return [f"{uuid.uuid4().hex}-{i}" for i in range(n)]


def fill_all(pool, sidecars, seed: int) -> None:
    fill_randomly(pool, seed)
    for i, p in enumerate(sidecars.values()):
        fill_randomly(p, seed * 10 + i + 1)


def sidecar_bytes(name, pool, pages, slots) -> bytes:
    return pool_page_bytes(pool, torch.tensor(slots) if name == "mamba" else tokens(pages))


@pytest.mark.parametrize("kind,layout", LAYOUTS)
def test_every_pool_round_trips_into_other_host_indices(kvtier_server, kind, layout):
    storage, pool, sidecars = hybrid_backend(kind, layout, kvtier_server.url)
    fill_all(pool, sidecars, 1)
    keys = keys_for(6)
    source, target = [1, 3, 5, 7, 9, 11], [40, 41, 42, 50, 51, 52]
    source_slots, target_slots = [1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25]
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens(source), keys=keys)
    stored = storage.batch_set_v2([kv, *v2_transfers(kind, keys, source, source_slots)])
    assert all(v == [True] * 6 for v in stored.values()), stored
    before = {name: sidecar_bytes(name, p, source, source_slots) for name, p in sidecars.items()}
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens(target), keys=keys)
    got = storage.batch_get_v2([kv, *v2_transfers(kind, keys, target, target_slots)])
    assert all(v == [True] * 6 for v in got.values()), got
    assert page_bytes(pool, target) == page_bytes(pool, source)
    for name, p in sidecars.items():
        assert sidecar_bytes(name, p, target, target_slots) == before[name], name
    # The KV pool's values are v1's: v1 reads what v2 wrote.
    saved = page_bytes(pool, source)
    fill_randomly(pool, 99)
    assert page_bytes(pool, target) != saved
    assert storage.batch_get_v1(keys, tokens(target)) == [True] * 6
    assert page_bytes(pool, target) == saved
    # Sidecar values live under their own tagged keys, apart from KV's.
    prefixes = {storage.pools[name].key_prefix for name in sidecars}
    assert "" not in prefixes and len(prefixes) == len(sidecars)
    # Every byte went through shared memory.
    assert kvtier_server.op("batch_put")["requests"] == 0


def test_exists_v2_applies_both_hit_policies(kvtier_server):
    storage, pool, sidecars = hybrid_backend("mha", "layer_first", kvtier_server.url)
    fill_all(pool, sidecars, 2)
    keys = keys_for(8)
    pages, slots = list(range(8)), list(range(1, 9))
    stored = storage.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=tokens(pages), keys=keys),
                                   *v2_transfers("mha", keys, pages, slots)])
    assert all(v == [True] * 8 for v in stored.values())
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        # Page 3 (0-based) loses its sliding-window value, page 6 its state.
        assert client.remove(storage.pools["swa"].key_prefix + keys[3]) == 0
        assert client.remove(storage.pools["mamba"].key_prefix + keys[6]) == 0
    window = PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    whole = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    state = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    # All pages: the prefix stops before the hole.
    r = storage.batch_exists_v2(keys, [whole])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    # A 2-page trailing window: only prefixes whose last 2 pages exist.
    r = storage.batch_exists_v2(keys, [window])
    assert r.restorable_prefix_pages == [1, 2, 3, 6, 7, 8] and r.kv_hit_pages == 8
    assert r.extra_pool_hit_pages[PoolName.KV] == 8
    # Two trailing pools intersect: the state of page 6 is gone.
    r = storage.batch_exists_v2(keys, [window, state])
    assert r.restorable_prefix_pages == [1, 2, 3, 6, 8] and r.kv_hit_pages == 8
    # A missing KV page bounds everything.
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        assert client.remove(keys[5]) == 0
    r = storage.batch_exists_v2(keys, [window])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [1, 2, 3])
    with pytest.raises(ValueError, match="not supported"):
        storage.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys,
                                                    hit_policy=PoolHitPolicy.BLOCK_GROUPS)])


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_another_process_reads_every_pool(kvtier_server, kind, layout):
    storage, pool, sidecars = hybrid_backend(kind, layout, kvtier_server.url)
    fill_all(pool, sidecars, 3)
    keys = keys_for(5)
    pages, slots = [2, 4, 6, 8, 10], [3, 5, 7, 9, 11]
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens(pages), keys=keys)
    assert all(all(v) for v in storage.batch_set_v2([kv, *v2_transfers(kind, keys, pages, slots)]).values())
    target, target_slots = [30, 31, 32, 33, 34], [40, 41, 42, 43, 44]
    args = {"v2": True, "kind": kind, "layout": layout, "url": kvtier_server.url, "keys": keys,
            "pages": target, "slots": target_slots}
    if kind == "mla":
        # Another tensor-parallel rank: the MLA pools are one value for all
        # ranks, the Mamba state is per rank (this one wrote rank 0's).
        args.update(tp_rank=1, tp_size=2)
    result = in_another_process(args)
    assert result["ok_kv"] == [True] * 5
    assert result["sha256"]["kv"] == hashlib.sha256(page_bytes(pool, pages)).hexdigest()
    for name, p in sidecars.items():
        if kind == "mla" and name == "mamba":
            assert result["ok"][name] == [False] * 5, "rank 1 read rank 0's state"
            continue
        assert result["ok"][name] == [True] * 5, name
        assert result["sha256"][name] == hashlib.sha256(sidecar_bytes(name, p, pages, slots)).hexdigest(), name


def test_mla_non_writer_ranks_write_only_their_own_pools(kvtier_server):
    storage, pool, sidecars = hybrid_backend("mla", "page_first", kvtier_server.url, tp_rank=1, tp_size=2)
    fill_all(pool, sidecars, 4)
    keys = keys_for(2)
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens([0, 1]), keys=keys)
    result = storage.batch_set_v2([kv, *v2_transfers("mla", keys, [0, 1], [1, 2])])
    assert all(v == [True, True] for v in result.values())
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        present = client.batch_is_exist([*keys, *(storage.pools["draft"].key_prefix + k for k in keys),
                                         *(storage.pools["mamba"].key_prefix + k for k in keys)])
    # KV and the draft pool (replicated) are rank 0's to write; the state is this rank's.
    assert list(present) == [0, 0, 0, 0, 1, 1]


def test_a_partial_batch_keeps_what_arrived_and_stops_at_the_first_miss(kvtier_server):
    probe, _, _ = hybrid_backend("mha", "page_first", kvtier_server.url)
    # Staging for 2 KV pages per direction: 6 pages take 3 rounds.
    storage, pool, sidecars = hybrid_backend("mha", "page_first", kvtier_server.url,
                                             staging_size=4 * probe.page_bytes)
    fill_all(pool, sidecars, 5)
    keys = keys_for(6)
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens(list(range(6))), keys=keys)
    assert all(all(v) for v in storage.batch_set_v2([kv]).values())
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        assert client.remove(keys[3]) == 0
    untouched = page_bytes(pool, [23, 24, 25])
    gets_before = kvtier_server.op("batch_get_shm_segments")["keys"]
    kv = PoolTransfer(name=PoolName.KV, host_indices=tokens(list(range(20, 26))), keys=keys)
    got = storage.batch_get_v2([kv])
    assert got[PoolName.KV] == [True, True, True, False, False, False]
    assert page_bytes(pool, [20, 21, 22]) == page_bytes(pool, [0, 1, 2])
    assert page_bytes(pool, [23, 24, 25]) == untouched
    # The round after the miss was never asked for.
    assert kvtier_server.op("batch_get_shm_segments")["keys"] - gets_before == 4
    # A server that is gone: every page is reported not loaded, promptly,
    # and the host memory stays as it was.
    kvtier_server.stop()
    try:
        before = page_bytes(pool, [40, 41])
        kv = PoolTransfer(name=PoolName.KV, host_indices=tokens([40, 41]), keys=keys[:2])
        assert storage.batch_get_v2([kv])[PoolName.KV] == [False, False]
        assert page_bytes(pool, [40, 41]) == before
    finally:
        kvtier_server.start()


def test_sets_and_gets_from_two_threads_do_not_mix_their_bytes(kvtier_server):
    # SGLang's backup thread sets while its prefetch thread gets.
    storage, pool, sidecars = hybrid_backend("mha", "layer_first", kvtier_server.url)
    fill_all(pool, sidecars, 6)
    read_keys = keys_for(4)
    assert storage.batch_set_v1(read_keys, tokens([0, 1, 2, 3])) == [True] * 4
    expected = page_bytes(pool, [0, 1, 2, 3])
    errors = []
    written = []

    def writer():
        for round_ in range(40):
            keys = keys_for(4)
            pages = [8 + (round_ % 8) * 4 + i for i in range(4)]
            if storage.batch_set_v1(keys, tokens(pages)) != [True] * 4:
                errors.append("set failed")
            written.append((keys, pages))

    def reader():
        for _ in range(40):
            if storage.batch_get_v1(read_keys, tokens([60, 61, 62, 63])) != [True] * 4:
                errors.append("get failed")
            elif page_bytes(pool, [60, 61, 62, 63]) != expected:
                errors.append("a get returned other bytes")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    # Every value written holds its own pages' bytes.
    with kvtier.Client(kvtier_server.url, namespace=storage.namespace) as client:
        for keys, pages in written[::5]:
            for key, page in zip(keys, pages):
                ptrs, sizes = pool.get_page_buffer_meta(tokens([page]))
                assert client.get(key) == b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))
