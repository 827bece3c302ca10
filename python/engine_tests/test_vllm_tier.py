"""kvtier as a secondary tier of vLLM's own offloading, driven by vLLM's
real TieringOffloadingManager with a real primary region on CPU and a real
`kvtier serve`."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtier import Client
from kvtier.integrations.vllm_tier import KvtierSecondaryTier

import vllm_tier_manager as vt

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def tiered(kvtier_server):
    m = vt.manager(kvtier_server.url)
    yield m, m.secondary_tiers[0]
    m.shutdown()


def test_vllm_loads_the_tier_from_its_configuration():
    assert SecondaryTierFactory.get_tier_class(dict(vt.TIER)) is KvtierSecondaryTier


def test_stores_cascade_and_a_cleared_primary_is_filled_back_with_the_same_bytes(kvtier_server, tiered):
    m, tier = tiered
    ks = vt.keys(6)
    vt.store(m, ks)
    assert tier.get_tier_stats()["stored"] == 6
    assert kvtier_server.stats()["store"]["puts"] >= 6
    # The primary forgets everything and its memory is wiped: only kvtier
    # holds the chunks now.
    vt.reset_primary(m)
    assert vt.load(m, ks) == [True] * 6
    assert tier.get_tier_stats()["loaded"] == 6
    # Never stored: a miss, nothing promoted.
    assert vt.load(m, vt.keys(2, salt="absent")) == [False, False]


def test_a_failed_load_is_reported_and_leaves_the_primary_alone(kvtier_server, tiered):
    m, tier = tiered
    absent = vt.keys(1, salt="never-stored")
    row = vt.primary(m)[3]
    row[:] = 0xAB
    job = TransferJob(job_id=10_001, keys=absent, chunk_ids=np.array([3], dtype=np.int32), is_promotion=True,
                      req_context=ReqContext(req_id="direct"))
    tier.submit_load(job)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    assert [(r.job_id, r.success, list(r.successful_keys)) for r in results] == [(10_001, False, [])]
    assert (row == 0xAB).all(), "a failed load wrote into the primary region"
    # A value of another size under the key: failed, never a short chunk.
    short = vt.keys(1, salt="short")
    with Client(kvtier_server.url, namespace=tier.namespace) as c:
        assert c.put(short[0], b"x" * 100) == 0
    tier.submit_load(TransferJob(job_id=10_002, keys=short, chunk_ids=np.array([3], dtype=np.int32),
                                 is_promotion=True, req_context=ReqContext(req_id="direct")))
    tier.drain_jobs()
    assert [r.success for r in tier.get_finished_jobs()] == [False]


def test_a_chunk_that_failed_to_load_is_a_miss_until_it_is_stored_again(kvtier_server, tiered):
    """The wrong value stays under the key, but the tier never offers it
    again (no loop of failed promotions); the next store of the chunk
    replaces it, and then it hits with the right bytes."""
    m, tier = tiered
    ks = vt.keys(3, salt="replaced")
    vt.store(m, ks)
    vt.reset_primary(m)
    with Client(kvtier_server.url, namespace=tier.namespace) as c:
        assert c.put(ks[1], b"x" * 100) == 0
        assert vt.load(m, ks) == [True, False, True]
        time.sleep(tier.lookup_ttl * 1.5)  # past the answers' lifetime: asked again
        vt.reset_primary(m)
        assert vt.load(m, ks[1:2]) == [False], "a chunk that failed to load was offered again"
        assert tier.get_tier_stats()["load_failures"] == 1
        vt.store(m, ks[1:2], req_id="recomputed")
        assert len(c.get(ks[1])) == len(c.get(ks[0]))
    vt.reset_primary(m)
    assert vt.load(m, ks) == [True, True, True]


def test_the_server_stopped_is_a_miss_and_failed_jobs_never_a_hang(kvtier_server, tiered):
    m, tier = tiered
    ks = vt.keys(2, salt="before-stop")
    vt.store(m, ks)
    vt.reset_primary(m)
    kvtier_server.stop()
    try:
        req = ReqContext(req_id="while-stopped")
        m.on_new_request(req)
        # Lookups of keys the tier has not seen fail over to a miss.
        assert vt.resolve(m, vt.keys(1, salt="unseen")[0], req) is LookupResult.MISS
        # A store while the server is away is a failed job, reported.
        job = TransferJob(job_id=20_001, keys=vt.keys(1, salt="lost"), chunk_ids=np.array([0], dtype=np.int32),
                          is_promotion=False, req_context=req)
        tier.submit_store(job)
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [False]
        m.on_request_finished(req)
    finally:
        kvtier_server.start()
    # Back: the chunks stored before the stop load (the disk tier kept them).
    time.sleep(tier.lookup_ttl)
    assert vt.load(m, ks) == [True, True]


def test_another_process_finds_and_loads_the_first_ones_chunks(kvtier_server, tiered):
    m, _ = tiered
    ks = vt.keys(4, salt="shared")
    vt.store(m, ks)
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "vllm_tier_manager.py"),
         json.dumps({"url": kvtier_server.url, "keys": [k.hex() for k in ks]})],
        capture_output=True, text=True, timeout=300, cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loaded": [True] * 4}


def test_keys_of_another_model_do_not_meet(kvtier_server, tiered):
    m, _ = tiered
    ks = vt.keys(2, salt="model-a")
    vt.store(m, ks)
    other = vt.manager(kvtier_server.url, model="another-model")
    try:
        assert vt.load(other, ks) == [False, False]
    finally:
        other.shutdown()


def test_a_hybrid_model_keeps_one_value_per_block_per_group(kvtier_server):
    """vLLM's offload key carries the KV cache group: the same block hash
    in two groups is two values, and a plain model's namespace never meets
    a hybrid one's."""
    hybrid = vt.manager(kvtier_server.url, groups=2)
    plain = vt.manager(kvtier_server.url)
    try:
        full, window = vt.keys(3, salt="hybrid", group=0), vt.keys(3, salt="hybrid", group=1)
        assert not set(full) & set(window)
        vt.store(hybrid, full + window)
        assert hybrid.secondary_tiers[0].get_tier_stats()["stored"] == 6
        vt.reset_primary(hybrid)
        # Each group's chunk comes back with its own bytes (the pattern is
        # a function of the whole key, group included).
        assert vt.load(hybrid, window + full) == [True] * 6
        assert hybrid.secondary_tiers[0].namespace != plain.secondary_tiers[0].namespace
        assert vt.load(plain, full) == [False] * 3
    finally:
        hybrid.shutdown()
        plain.shutdown()
