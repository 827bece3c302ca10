"""kvtier as LMCache's L2 through its native plugin: LMCache's own
config parser and adapter factory build its real NativeConnectorL2Adapter
around kvtier.integrations.lmcache.KvtierL2Connector, and the tests drive
the adapter the way LMCache's storage manager does (submit, wait on the
adapter's eventfds, collect), against a real `kvtier serve`. LMCache comes
from scripts/peer-stores (its wheel beside the engines' environment);
scripts/engine-tests runs this file with it on PYTHONPATH."""

import hashlib
import json
import pathlib
import select
import subprocess
import sys
import time

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from kvtier.integrations.lmcache import KvtierL2Connector

from conftest import REPO, kvtier_binary

SIZE = 64 << 10


# The made-up models these tests name have no weights to fingerprint: pinned.
PINS = {f"org/model-{c}": f"test:model-{c}" for c in "abcd"}


def adapter_for(url: str, **params):
    config = get_l2_adapter_config_class("native_plugin").from_dict({
        "type": "native_plugin", "module_path": "kvtier.integrations.lmcache",
        "class_name": "KvtierL2Connector",
        "adapter_params": {"kvtier_url": url, "model_fingerprints": PINS, **params},
    })
    return create_l2_adapter_from_registry(config)


@pytest.fixture
def adapter(kvtier_server):
    a = adapter_for(kvtier_server.url)
    yield a
    a.close()


def key(i: int, model: str = "org/model-a", rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=hashlib.sha256(f"chunk-{i}".encode()).digest(), model_name=model, kv_rank=rank,
                     cache_salt=salt)


def obj(fill: bytes | None = None) -> TensorMemoryObj:
    data = torch.zeros(SIZE, dtype=torch.uint8)
    if fill is not None:
        data.copy_(torch.frombuffer(bytearray(fill), dtype=torch.uint8))
    meta = MemoryObjMetadata(shape=torch.Size([SIZE]), dtype=torch.uint8, address=0, phy_size=SIZE, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD if hasattr(MemoryFormat, "KV_2LTD") else MemoryFormat.UNDEFINED)
    return TensorMemoryObj(data, meta, None)


def pattern(k: ObjectKey) -> bytes:
    return hashlib.shake_256(k.chunk_hash + k.model_name.encode() + bytes([k.kv_rank])).digest(SIZE)


def wait(fd: int, result, timeout: float = 30.0):
    """LMCache's way: wait for the adapter's eventfd, then ask once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = result()
        if out is not None:
            return out
        select.select([fd], [], [], 0.2)
    raise AssertionError("the adapter never completed the task")


def store(adapter, keys):
    # The adapter hands raw views of the objects to the connector: they
    # must live until the task completes (LMCache's L1 holds them so).
    objs = [obj(pattern(k)) for k in keys]
    task = adapter.submit_store_task(keys, objs)
    results = {}

    def done():
        results.update(adapter.pop_completed_store_tasks())
        return results.get(task)

    result = wait(adapter.get_store_event_fd(), done)
    del objs
    return result


def lookup(adapter, keys) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = wait(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task))
    adapter.submit_unlock([k for i, k in enumerate(keys) if bitmap.test(i)])
    return [bitmap.test(i) for i in range(len(keys))]


def load(adapter, keys) -> list[bool]:
    """Per key: loaded, with exactly the stored bytes."""
    objs = [obj() for _ in keys]
    task = adapter.submit_load_task(keys, objs)
    bitmap = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return [bitmap.test(i) and bytes(o.byte_array) == pattern(k) for i, (k, o) in enumerate(zip(keys, objs))]


def test_store_lookup_and_load_through_lmcaches_adapter(adapter, kvtier_server):
    keys = [key(i) for i in range(8)]
    result = store(adapter, keys)
    assert result.is_successful() and result.bytes_transferred() == 8 * SIZE
    missing = [key(100), key(101)]
    assert lookup(adapter, keys + missing) == [True] * 8 + [False, False]
    assert load(adapter, keys) == [True] * 8
    assert load(adapter, missing) == [False, False]
    stats = kvtier_server.stats()["store"]
    assert stats["checksum_failures"] == 0 and stats["puts"] >= 8


def test_keys_of_another_model_rank_or_salt_do_not_meet(adapter):
    store(adapter, [key(i) for i in range(3)])
    others = [key(0, model="org/model-b"), key(1, rank=1), key(2, salt="user-7")]
    assert lookup(adapter, others) == [False] * 3
    assert load(adapter, others) == [False] * 3


def test_a_kvtier_restart_keeps_lmcache_serving_and_the_blocks(adapter, kvtier_server):
    keys = [key(i) for i in range(6)]
    assert store(adapter, keys).is_successful()
    kvtier_server.stop()
    try:
        # The server is away: lookups and loads are misses, stores fail;
        # nothing raises into LMCache and nothing hangs.
        assert lookup(adapter, keys[:2]) == [False, False]
        assert load(adapter, keys[:2]) == [False, False]
        assert not store(adapter, [key(50)]).is_successful()
    finally:
        kvtier_server.start()
    # The same adapter (LMCache never restarted) reconnects; the blocks were
    # flushed at the clean stop and come back from kvtier's disk tier.
    assert lookup(adapter, keys) == [True] * 6
    assert load(adapter, keys) == [True] * 6
    assert kvtier_server.stats()["store"]["disk_hits"] >= 6


def test_delete_and_bad_input(adapter, kvtier_server):
    keys = [key(i, model="org/model-d") for i in range(4)]
    store(adapter, keys)
    adapter.delete(keys[:2])
    assert lookup(adapter, keys) == [False, False, True, True]
    connector = KvtierL2Connector(kvtier_url=kvtier_server.url, model_fingerprints=PINS)
    try:
        # A key that is not LMCache's, and buffers that do not match: a
        # failed completion, never an exception lost in a thread.
        fid = connector.submit_batch_exists(["not-a-key"])
        deadline = time.monotonic() + 10
        done = []
        while not done and time.monotonic() < deadline:
            select.select([connector.event_fd()], [], [], 0.2)
            done = connector.drain_completions()
        assert done and done[0][0] == fid and done[0][1] is False and "not an LMCache object key" in done[0][2]
        with pytest.raises(ValueError):
            connector.submit_batch_get(["m@0@0@00"], [])
        with pytest.raises(ValueError):
            KvtierL2Connector(kvtier_url=kvtier_server.url, unknown_option=1)
        with pytest.raises(ValueError, match="model_fingerprints"):
            KvtierL2Connector(kvtier_url=kvtier_server.url, model_fingerprints={"org/model-a": 7})
    finally:
        connector.close()


def test_a_model_is_named_by_its_weights_and_one_without_any_is_refused(kvtier_server, tmp_path):
    """Unpinned, a model's namespace comes from the weights its name leads
    to: a copy elsewhere shares blocks, other weights at the same name do
    not; a name that leads to no weights is refused, never cached under
    the bare name."""
    import shutil
    import struct

    def write_model(root, fill: int):
        root.mkdir(parents=True, exist_ok=True)
        header = b'{"w":{"dtype":"U8","shape":[65536],"data_offsets":[0,65536]}}'
        (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes([fill]) * 65536)
        (root / "config.json").write_text('{"model_type": "llama"}')

    first, copy = tmp_path / "host-a" / "llama", tmp_path / "host-b" / "llama-copy"
    write_model(first, 1)
    shutil.copytree(first, copy)
    a = adapter_for(kvtier_server.url, namespace_prefix="team-a")
    try:
        assert store(a, [key(i, model=str(first)) for i in range(3)]).is_successful()
        assert lookup(a, [key(i, model=str(copy)) for i in range(3)]) == [True] * 3
        write_model(copy, 2)  # other weights in place
        assert lookup(a, [key(i, model=str(copy)) for i in range(3)]) == [False] * 3
        # No weights, no pin: every call for that model fails, saying why.
        assert not store(a, [key(0, model="org/unknown")]).is_successful()
        assert lookup(a, [key(0, model="org/unknown")]) == [False]
    finally:
        a.close()


def test_lmcaches_server_starts_with_kvtier_as_its_l2(kvtier_server, tmp_path):
    """The real `lmcache server` with the documented --l2-adapter JSON: it
    builds the kvtier connector (which connects at once) and serves."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    adapter = {"type": "native_plugin", "module_path": "kvtier.integrations.lmcache",
               "class_name": "KvtierL2Connector",
               "adapter_params": {"kvtier_url": kvtier_server.url, "model_fingerprints": PINS}}
    log = tmp_path / "lmcache-server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1", "--port", str(port),
             "--l1-size-gb", "1", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
        )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert server.poll() is None, log.read_text()[-3000:]
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.3)
            else:
                raise AssertionError("lmcache server never listened:\n" + log.read_text()[-3000:])
            text = log.read_text()
            assert "kvtier.integrations.lmcache.KvtierL2Connector" in text, text[-3000:]
        finally:
            server.terminate()
            server.wait(timeout=60)


def test_the_paired_bench_compares_loads_that_return_the_stored_bytes(tmp_path):
    """scripts/lmcache-l2-bench's paired part, small: kvtier's plugin and
    LMCache's fs_native client in turn, every loaded byte compared with
    the source (the script fails on a difference, a failed completion or a
    missing one), and a report of both."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "paired.json"
    subprocess.run([sys.executable, str(REPO / "python" / "benchmarks" / "lmcache_paired.py"), kvtier_binary(),
                    str(work), "4", "256", "2", "6", str(out)], check=True, timeout=300)
    report = json.loads(out.read_text())
    for op, rounds in (("store", 2), ("load", 6)):
        for kind in ("kvtier", "fs_native"):
            assert report[op][kind]["rounds"] == rounds, report
            assert report[op][kind]["mb_s"] > 0, report
        assert report[op]["kvtier_to_fs_native"] > 0, report
