import os
import pathlib
import threading
import uuid

import numpy as np
import pytest

import kvtier
from kvtier import errors


def pattern(key, size):
    """Bytes derived from the key, never zeros."""
    seed = abs(hash(key)) % (2**32) or 1
    return np.random.default_rng(seed).integers(1, 255, size=size, dtype=np.uint8)


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex}"


def test_put_get_remove_both_key_types(engine):
    k = unique("k")
    assert engine.put(k, b"hello") == errors.OK
    assert engine.get(k) == b"hello"
    assert engine.get(k.encode()) == b"hello"  # str and bytes name the same key
    assert engine.is_exist(k) == 1
    assert engine.get(unique("absent")) == b""
    assert engine.remove(k) == errors.OK
    assert engine.remove(k) == errors.NOT_FOUND
    assert engine.is_exist(k.encode()) == 0


def test_batch_buffers_numpy_bytearray_memoryview(engine):
    keys = [unique("b") for _ in range(4)]
    values = [pattern(k, 65536 + i) for i, k in enumerate(keys)]
    assert engine.batch_put_from(keys, values) == [0, 0, 0, 0]
    assert engine.batch_is_exist(keys + [unique("no")]) == [1, 1, 1, 1, 0]
    assert engine.prefix_len(keys) == 4
    outs = [np.zeros(len(v), dtype=np.uint8) for v in values[:2]]
    outs.append(bytearray(len(values[2])))
    outs.append(memoryview(bytearray(len(values[3]))))
    got = engine.batch_get_into(keys, outs)
    assert got == [len(v) for v in values]
    for out, value in zip(outs, values):
        assert bytes(out) == value.tobytes()
    engine.flush()
    stats = engine.stats()
    assert isinstance(stats, dict)


def test_mooncake_raw_pointer_api(engine):
    keys = [unique("raw") for _ in range(3)]
    size = 32768
    source = np.concatenate([pattern(k, size) for k in keys])
    dest = np.zeros_like(source)
    assert engine.register_buffer(source.ctypes.data, source.nbytes) == 0
    assert engine.register_buffer(dest.ctypes.data, dest.nbytes) == 0
    ptrs = [source.ctypes.data + i * size for i in range(3)]
    assert engine.batch_put_from(keys, ptrs, [size] * 3) == [0, 0, 0]
    dptrs = [dest.ctypes.data + i * size for i in range(3)]
    assert engine.batch_get_into(keys, dptrs, [size] * 3) == [size] * 3
    assert np.array_equal(source, dest)
    # A miss and a too-small destination, per key.
    got = engine.batch_get_into([unique("miss"), keys[0]], dptrs[:2], [size, 100])
    assert got == [errors.NOT_FOUND, errors.BUFFER_TOO_SMALL]
    # Pointers outside registered memory are refused, not dereferenced.
    scratch = np.zeros(size, dtype=np.uint8)
    assert engine.batch_get_into([keys[0]], [scratch.ctypes.data], [size]) == [errors.INVALID_ARGUMENT]
    assert engine.batch_put_from([keys[0]], [12345], [size]) == [errors.INVALID_ARGUMENT]
    assert engine.unregister_buffer(dest.ctypes.data) == 0
    assert engine.batch_get_into([keys[0]], [dptrs[0]], [size]) == [errors.INVALID_ARGUMENT]


def test_register_buffer_refuses_what_it_cannot_trust(engine):
    with pytest.raises(ValueError, match="not wholly mapped"):
        engine.register_buffer(4096, 1 << 20)           # the zero page is never mapped
    with pytest.raises(ValueError, match="non-null"):
        engine.register_buffer(0, 4096)
    array = np.zeros(1 << 20, dtype=np.uint8)
    assert engine.register_buffer(array.ctypes.data, array.nbytes) == 0
    with pytest.raises(ValueError, match="overlaps"):
        engine.register_buffer(array.ctypes.data + 4096, 4096)
    assert engine.unregister_buffer(array.ctypes.data) == 0
    with pytest.raises(ValueError, match="writable"):
        engine.register_buffer(b"read-only bytes")


def test_a_registered_object_is_kept_alive_and_cannot_be_resized(engine):
    import gc
    import weakref

    buf = bytearray(256 * 1024)
    address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    assert engine.register_buffer(buf) == 0
    with pytest.raises(BufferError):
        buf.extend(b"x" * 4096)                         # exported: no resize
    key = b"registered-object"
    assert engine.batch_put_from([key], [address], [4096]) == [0]
    assert engine.batch_get_into([key], [address + 8192], [4096]) == [4096]

    class Holder(np.ndarray):
        pass

    owned = np.zeros(1 << 16, dtype=np.uint8).view(Holder)
    watch = weakref.ref(owned)
    owned_address = owned.ctypes.data
    assert engine.register_buffer(owned) == 0
    del owned
    gc.collect()
    assert watch() is not None, "the registry keeps the object alive"
    assert engine.batch_get_into([key], [owned_address], [4096]) == [4096]
    assert engine.unregister_buffer(owned_address) == 0
    gc.collect()
    assert watch() is None, "unregistering lets it go"
    assert engine.unregister_buffer(address) == 0


def test_unregister_waits_for_calls_using_the_range(engine):
    import threading

    size = 4 << 20
    keys = [f"wait-{i}".encode() for i in range(8)]
    source = np.ones(size * len(keys), dtype=np.uint8)
    assert engine.batch_put_from(keys, [source[i * size:(i + 1) * size] for i in range(len(keys))]) == [0] * 8
    dest = np.zeros(size * len(keys), dtype=np.uint8)
    assert engine.register_buffer(dest.ctypes.data, dest.nbytes) == 0
    results, done = [], threading.Event()

    def reader():
        for _ in range(20):
            results.append(engine.batch_get_into(keys, [dest.ctypes.data + i * size for i in range(8)], [size] * 8))
        done.set()

    thread = threading.Thread(target=reader)
    thread.start()
    while not results:
        pass
    assert engine.unregister_buffer(dest.ctypes.data) == 0
    # From here on no call may write into dest: later calls are refused.
    dest[:] = 7
    thread.join()
    assert (dest == 7).all(), "a call wrote into the range after unregister returned"
    assert all(r == [size] * 8 or r == [errors.INVALID_ARGUMENT] * 8 for r in results)
    assert len(results) == 20


def test_bad_input(engine):
    k = unique("bad")
    engine.put(k, b"x" * 100)
    with pytest.raises(ValueError, match="writable"):
        engine.batch_get_into([k], [b"read-only bytes"])
    with pytest.raises(ValueError, match="contiguous"):
        engine.batch_get_into([k], [np.zeros((10, 20), dtype=np.uint8)[:, ::2]])
    with pytest.raises(ValueError, match="one per key"):
        engine.batch_put_from([k, k], [b"a"])
    with pytest.raises(ValueError, match="one per key"):
        engine.batch_get_into([k], [1, 2], [3, 4])
    with pytest.raises(ValueError, match="str or bytes"):
        engine.put(42, b"x")
    with pytest.raises(ValueError, match="overlap"):
        buf = bytearray(200)
        engine.batch_get_into([k, k], [memoryview(buf)[0:150], memoryview(buf)[100:200]])
    assert engine.batch_put_from(["k" * 257], [b"v"]) == [errors.INVALID_ARGUMENT]
    assert engine.batch_put_from([k], [b""]) == [errors.INVALID_ARGUMENT]
    assert engine.get_into(k, bytearray(10)) == errors.BUFFER_TOO_SMALL


def test_closed_store_raises(tmp_path):
    s = kvtier.Store(str(tmp_path / "s"), memory="16MiB", disk="64MiB")
    s.put("k", b"v")
    s.close()
    with pytest.raises(kvtier.KvtierError, match="closed"):
        s.flush()
    assert s.batch_put_from(["k"], [b"v"]) == [errors.CLOSED]


def test_forked_child_is_refused_and_parent_keeps_working(tmp_path):
    import os

    s = kvtier.Store(str(tmp_path / "s"), memory="16MiB", disk="64MiB")
    s.put("k", b"v" * 5000)
    s.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            s.get("k")
        except kvtier.KvtierError as e:
            if "fork" in str(e) and s.batch_put_from(["x"], [b"y"]) == [errors.CLOSED]:
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert s.get("k") == b"v" * 5000
    s.put("after", b"z" * 100)
    s.close()


def test_locked_directory(tmp_path):
    with kvtier.Store(str(tmp_path / "s"), memory="16MiB", disk="64MiB"):
        with pytest.raises(kvtier.KvtierError, match="in use"):
            kvtier.Store(str(tmp_path / "s"), memory="16MiB", disk="64MiB")


def test_reopen_keeps_flushed_values(tmp_path):
    path = str(tmp_path / "s")
    with kvtier.Store(path, memory="16MiB", disk="64MiB") as s:
        s.batch_put_from(["a", "b"], [b"1" * 5000, b"2" * 5000])
        s.flush()
    with kvtier.Store(path, memory="16MiB", disk="64MiB") as s:
        assert s.get("a") == b"1" * 5000
        assert s.stats()["disk_entries"] == 2


def test_shared_dir_makes_one_nodes_blocks_another_nodes_disk_hits(tmp_path):
    """Two embedded stores (two nodes) with their own data directories and
    one shared directory: blocks flushed by one are read by the other from
    the shared files, verified."""
    import time

    shared = str(tmp_path / "shared")
    opts = dict(memory="16MiB", disk="64MiB", shared_dir=shared)
    with kvtier.Store(str(tmp_path / "b"), **opts) as b, kvtier.Store(str(tmp_path / "c"), **opts) as c:
        values = [bytes([i]) * 20_000 for i in range(1, 9)]
        keys = [f"block-{i}" for i in range(8)]
        assert b.batch_put_from(keys, values) == [0] * 8
        b.flush()
        deadline = time.monotonic() + 10
        while not all(c.batch_is_exist(keys)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(c.batch_is_exist(keys))
        assert [c.get(k) for k in keys] == values
        stats = c.stats()
        assert stats["shared_dir"] is True
        assert stats["shared_reads"] == 8
        assert stats["shared_writers"] == 1


def test_recovery_findings_reach_python_logging_and_stats(tmp_path, caplog):
    """What recovery decides is visible to the embedded store's user: a
    quarantined region file and a region whose header was damaged come out
    as a WARNING on the "kvtier" logger and as counts in stats()."""
    import glob
    import logging
    import os

    path = str(tmp_path / "s")
    with kvtier.Store(path, memory="16MiB", disk="64MiB", region_size="1MiB") as s:
        s.batch_put_from(["a", "b"], [b"1" * 5000, b"2" * 5000])
        s.flush()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        with kvtier.Store(path, memory="16MiB", disk="64MiB", region_size="1MiB") as s:
            assert s.stats()["quarantined_regions"] == 0
    assert not [r for r in caplog.records if r.name == "kvtier"], "a healthy open says nothing"
    (region,) = glob.glob(os.path.join(path, "regions", "*.kvr"))
    with open(region, "r+b") as f:
        f.seek(13)  # the region id in the header
        byte = f.read(1)
        f.seek(13)
        f.write(bytes([byte[0] ^ 1]))
    with open(os.path.join(path, "regions", "0000ffff.kvr"), "wb") as f:
        f.write(b"\xab" * 8192)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        with kvtier.Store(path, memory="16MiB", disk="64MiB", region_size="1MiB") as s:
            stats = s.stats()
            assert s.get("a") == b"1" * 5000, "the damaged header hid nothing"
    assert stats["quarantined_regions"] == 1 and stats["damaged_headers"] == 1, stats
    messages = [r.getMessage() for r in caplog.records if r.name == "kvtier"]
    assert len(messages) == 1, messages
    assert "quarantine" in messages[0] and "damaged header" in messages[0], messages


def test_many_threads_share_one_object(engine):
    errors_seen = []

    def work(t):
        try:
            for i in range(20):
                k = f"thread-{t}-{i}-{uuid.uuid4().hex}"
                v = pattern(k, 8192)
                assert engine.batch_put_from([k], [v]) == [0]
                out = np.zeros(8192, dtype=np.uint8)
                assert engine.batch_get_into([k], [out]) == [8192]
                assert np.array_equal(out, v)
        except Exception as e:  # pragma: no cover - reported below
            errors_seen.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors_seen, errors_seen


def test_client_threads_run_on_a_pool_of_connections(server):
    """Calls from several threads open more connections, up to the limit,
    and every one of them reads and writes the same shared buffer."""
    with kvtier.Client(server["unix"], shm_size="16MiB", connections=3) as c:
        before = c.stats()["server"]["connections_total"]
        size = 256 << 10
        buf = c.alloc_buffer(6 * size)
        view = np.frombuffer(buf, dtype=np.uint8)
        barrier = threading.Barrier(6)
        errors_seen = []

        def work(t):
            try:
                barrier.wait()
                mine = view[t * size:(t + 1) * size]
                ptr = buf.ptr + t * size
                for i in range(30):
                    k = unique(f"pool-{t}-{i}")
                    mine[:] = pattern(k, size)
                    assert c.batch_put_from([k], [ptr], [size]) == [0]
                    mine[:] = 0
                    assert c.batch_get_into([k], [ptr], [size]) == [size]
                    assert np.array_equal(mine, pattern(k, size))
            except Exception as e:  # pragma: no cover - reported below
                errors_seen.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors_seen, errors_seen
        opened = c.stats()["server"]["connections_total"] - before
        # The first connection was open before; at most two more.
        assert 1 <= opened <= 2, opened
    with pytest.raises(ValueError, match="connections"):
        kvtier.Client(server["unix"], connections=0)


def test_async_calls_overlap_and_return_what_the_sync_calls_return(engine):
    size = 128 << 10
    keys = [unique("async") for _ in range(8)]
    values = [pattern(k, size) for k in keys]
    first = engine.batch_put_from_async(keys[:4], values[:4])
    second = engine.batch_put_from_async(keys[4:], values[4:], memory_only=True)
    assert isinstance(first, kvtier.PendingCall)
    assert first.wait() == [0] * 4 and second.wait() == [0] * 4
    assert first.done() and second.wait() == [0] * 4  # the same again
    outs = [np.zeros(size, dtype=np.uint8) for _ in keys]
    pending = [engine.batch_get_into_async(keys[i:i + 2], outs[i:i + 2]) for i in range(0, 8, 2)]
    assert [p.wait() for p in pending] == [[size, size]] * 4
    for out, value in zip(outs, values):
        assert np.array_equal(out, value)
    # Per-key failures come back as codes, bad arguments raise at once.
    small = np.zeros(16, dtype=np.uint8)
    missing = np.zeros(16, dtype=np.uint8)
    got = engine.batch_get_into_async([keys[0], unique("absent")], [small, missing]).wait()
    assert got == [kvtier.errors.BUFFER_TOO_SMALL, kvtier.errors.NOT_FOUND]
    with pytest.raises(ValueError):
        engine.batch_get_into_async([keys[0]], [small, missing])
    with pytest.raises(ValueError, match="overlap"):
        engine.batch_get_into_async(keys[:2], [outs[0], outs[0]])


def test_async_calls_notify_an_eventfd_when_done(engine):
    """``notify_fd``: 1 is written to the eventfd once per finished call
    (an event loop learns of completions without a thread waiting)."""
    import os
    import select

    size = 1 << 20
    keys = [unique("notify") for _ in range(6)]
    values = [pattern(k, size) for k in keys]
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        calls = [engine.batch_put_from_async(keys[i:i + 2], values[i:i + 2], notify_fd=efd) for i in range(0, 6, 2)]
        counted = 0
        while counted < len(calls):
            assert select.select([efd], [], [], 60)[0], "no completion was signalled"
            counted += os.eventfd_read(efd)
        assert counted == 3 and all(c.done() for c in calls)
        assert [c.wait() for c in calls] == [[0, 0]] * 3
        outs = [np.zeros(size, dtype=np.uint8) for _ in keys]
        got = engine.batch_get_into_async(keys, outs, notify_fd=efd)
        assert select.select([efd], [], [], 60)[0]
        assert os.eventfd_read(efd) == 1 and got.done()
        assert got.wait() == [size] * 6
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
    finally:
        os.close(efd)


def _async_threads() -> int:
    """This process's threads that run async calls (named kvtier-async)."""
    count = 0
    for task in pathlib.Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == "kvtier-async"
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return count


def test_async_calls_never_wait_behind_a_stuck_call_and_threads_are_kept(store):
    """Async calls run on kept threads (one starts without creating a
    thread), but never queue behind each other: a call stuck in its
    completion (its notify_fd, a pipe here, is full) holds its own thread
    only, and its wait() returns only after that write (the caller may
    close the descriptor then). Idle threads are kept up to 4."""
    import fcntl
    import select
    import time

    size = 64 << 10
    keys = [unique("kept") for _ in range(4)]
    values = [pattern(k, size) for k in keys]
    assert store.batch_put_from(keys, values) == [0] * 4
    read_end, write_end = os.pipe()
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        # Fill the pipe: the stuck call's 8-byte completion write blocks.
        fcntl.fcntl(write_end, fcntl.F_SETFL, os.O_NONBLOCK)
        filler = 0
        while True:
            try:
                filler += os.write(write_end, b"\0" * 4096)
            except BlockingIOError:
                break
        fcntl.fcntl(write_end, fcntl.F_SETFL, 0)
        outs = [np.zeros(size, dtype=np.uint8) for _ in range(6)]
        stuck = store.batch_get_into_async(keys[:1], outs[:1], notify_fd=write_end)
        waited = []
        waiter = threading.Thread(target=lambda: waited.append(stuck.wait()))
        waiter.start()
        later = [store.batch_get_into_async([k], [o], notify_fd=efd) for k, o in zip(keys, outs[1:5])]
        counted = 0
        while counted < len(later):
            assert select.select([efd], [], [], 60)[0], "a call waited behind the stuck one"
            counted += os.eventfd_read(efd)
        assert [c.wait() for c in later] == [[size]] * 4
        assert all(np.array_equal(o, v) for o, v in zip(outs[1:5], values))
        deadline = time.monotonic() + 60
        while not stuck.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stuck.done() and not waited, "wait() returned before the notification was written"
        # Unstick it: its notification follows the filler.
        got = b""
        while len(got) < filler + 8:
            assert select.select([read_end], [], [], 60)[0], "the stuck call never notified"
            got += os.read(read_end, 1 << 16)
        assert got[filler:] == (1).to_bytes(8, "little")
        waiter.join(60)
        assert waited == [[size]]
        # Its value was copied before its notification (the thread may have
        # started after the later calls ended: checked only now).
        assert np.array_equal(outs[0], values[0])
    finally:
        os.close(efd)
    # Calls one after another reuse kept threads: at most 4 stay.
    for _ in range(20):
        assert store.batch_get_into_async(keys[:1], outs[5:6]).wait() == [size]
    deadline = time.monotonic() + 60
    while _async_threads() > 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 1 <= _async_threads() <= 4
    os.close(read_end)
    os.close(write_end)


def test_unix_clients_move_values_by_cross_memory_transfers(server):
    """Values in plain Python buffers (not a shared buffer) cross between
    the server's pool and the caller's memory once, by cross-memory
    attach; a client that turns it off gets the socket, with the same
    answers. Batches past 8 MiB move on two connections at once. (The
    pool is not mapped here: gets of values in the server's memory would
    be copied out of the mapping instead.)"""
    size = 1 << 20
    keys = [unique("cross") for _ in range(24)]
    values = [pattern(k, size) for k in keys]
    with kvtier.Client(server["unix"], shm_size=0, map_pool=False) as c:
        before = c.stats()["server"]["ops"]
        assert c.batch_put_from(keys, values) == [0] * 24
        outs = [np.zeros(size + 3, dtype=np.uint8) for _ in keys]
        assert c.batch_get_into(keys, outs) == [size] * 24
        assert all(np.array_equal(o[:size], v) and not o[size:].any() for o, v in zip(outs, values))
        after = c.stats()["server"]["ops"]
        # 24 MiB: cut in parts, one request each (one part per core, at
        # most one per connection: one on a one-core machine).
        parts = min(2, len(os.sched_getaffinity(0)))
        for op in ("batch_put_shm_segments", "batch_get_shm_segments"):
            assert after[op]["requests"] - before[op]["requests"] >= parts, op
        for op in ("batch_put", "batch_get"):
            assert after[op]["requests"] == before[op]["requests"], op
    with kvtier.Client(server["unix"], shm_size=0, cross_memory=False, map_pool=False) as c:
        outs = [np.zeros(size, dtype=np.uint8) for _ in keys]
        before = c.stats()["server"]["ops"]["batch_get"]["requests"]
        assert c.batch_get_into(keys, outs) == [size] * 24
        assert all(np.array_equal(o, v) for o, v in zip(outs, values))
        assert c.stats()["server"]["ops"]["batch_get"]["requests"] > before


def test_unix_clients_copy_values_out_of_the_mapped_pool(server):
    """A client of the server's own user maps its pool read-only: values in
    the server's memory are leased in one request and copied here (two
    threads past 8 MiB), never sent or written by the server; values that
    are not there (a miss, a buffer too small) come by the other paths."""
    size = 1 << 20
    keys = [unique("mapped") for _ in range(24)]
    values = [pattern(k, size) for k in keys]
    with kvtier.Client(server["unix"], shm_size=0) as c:
        assert c.batch_put_from(keys, values) == [0] * 24
        outs = [np.zeros(size + 3, dtype=np.uint8) for _ in keys]
        before = c.stats()["server"]["ops"]
        assert c.batch_get_into(keys, outs) == [size] * 24
        assert all(np.array_equal(o[:size], v) and not o[size:].any() for o, v in zip(outs, values))
        after = c.stats()["server"]["ops"]
        assert after["lease_values"]["requests"] - before["lease_values"]["requests"] == 1
        for op in ("batch_get", "batch_get_shm_segments"):
            assert after[op]["requests"] == before[op]["requests"], op
        small = np.zeros(10, dtype=np.uint8)
        absent = np.zeros(10, dtype=np.uint8)
        got = c.batch_get_into([keys[0], unique("absent")], [small, absent])
        assert got == [kvtier.errors.BUFFER_TOO_SMALL, kvtier.errors.NOT_FOUND]
        assert c.stats()["server"]["ops"]["release_lease"]["requests"] >= 1


def test_alloc_buffer_zero_copy_path(server):
    with kvtier.Client(server["unix"], shm_size="16MiB") as c:
        buf = c.alloc_buffer(4 * 65536)
        view = np.frombuffer(buf, dtype=np.uint8)
        keys = [unique("shm") for _ in range(4)]
        for i, k in enumerate(keys):
            view[i * 65536:(i + 1) * 65536] = pattern(k, 65536)
        slices = [memoryview(buf)[i * 65536:(i + 1) * 65536] for i in range(4)]
        before = c.stats()["server"]["ops"]
        assert c.batch_put_from(keys, slices) == [0] * 4
        # Values in shared memory are read by the server in place.
        ops = c.stats()["server"]["ops"]
        assert ops["batch_put_shm"]["keys"] - before["batch_put_shm"]["keys"] == 4, ops
        assert ops["batch_put"]["requests"] == before["batch_put"]["requests"], ops
        view[:] = 0
        # Raw pointers into the allocated buffer are registered too.
        ptrs = [buf.ptr + i * 65536 for i in range(4)]
        assert c.batch_get_into(keys, ptrs, [65536] * 4) == [65536] * 4
        for i, k in enumerate(keys):
            assert np.array_equal(view[i * 65536:(i + 1) * 65536], pattern(k, 65536))
        with pytest.raises(ValueError, match="shared buffer"):
            c.alloc_buffer(1 << 30)


def test_namespaces_never_meet(tmp_path, server):
    key = kvtier.block_keys(list(range(256)), 256)[0]
    with kvtier.Store(str(tmp_path / "ns"), memory="16MiB", disk="64MiB", namespace="llama/bf16/tp0of2") as bf16:
        assert bf16.put(key, b"bf16 bytes" * 100) == 0
        bf16.flush()
    with kvtier.Store(str(tmp_path / "ns"), memory="16MiB", disk="64MiB", namespace="llama/fp8/tp0of2") as fp8:
        assert fp8.is_exist(key) != 1
        assert fp8.get(key) == b""
    with kvtier.Store(str(tmp_path / "ns"), memory="16MiB", disk="64MiB", namespace="llama/bf16/tp0of2") as bf16:
        assert bf16.get(key) == b"bf16 bytes" * 100
    # Through the server: one namespace per client.
    with kvtier.Client(server["unix"], namespace="a", shm_size="1MiB") as a, \
            kvtier.Client(server["tcp"], namespace="b", auth_token=server["token"]) as b:
        assert a.put(key, b"from a" * 10) == 0
        assert b.batch_is_exist([key]) == [0]
        assert b.put(key, b"from b" * 10) == 0
        assert a.get(key) == b"from a" * 10 and b.get(key) == b"from b" * 10
    with pytest.raises(kvtier.KvtierError, match="namespace"):
        kvtier.Store(str(tmp_path / "bad"), memory="16MiB", disk="0", namespace="x" * 200)


def test_tcp_needs_the_token(server):
    with pytest.raises(kvtier.KvtierError, match="unauthorized"):
        kvtier.Client(server["tcp"], auth_token="")
    with pytest.raises(kvtier.KvtierError, match="unauthorized"):
        kvtier.Client(server["tcp"], auth_token="x" * 64)


def test_client_errors(server, tmp_path):
    with pytest.raises(kvtier.KvtierError):
        kvtier.Client("tcp://127.0.0.1:1")
    with pytest.raises(kvtier.KvtierError, match="unsupported URL"):
        kvtier.Client("http://example")
    with kvtier.Client(server["tcp"], auth_token=server["token"]) as c:
        with pytest.raises(RuntimeError, match="unix://"):
            c.alloc_buffer(4096)


def test_block_keys_vectors():
    keys = kvtier.block_keys(list(range(10)), block_size=4)
    assert [k.hex() for k in keys] == [
        "9941b995a131c3d47a9775630915e6f364e7d0fbddeef515ecd83857d9d209bd",
        "fdbea0a8db9851a21daf231d175175eef988ea431b32e41ef86844d7876649b6",
    ]
    salted = kvtier.block_keys(list(range(10)), block_size=4, salt=b"model-a")
    assert salted[0].hex() == "f6d35cf1145a944cbda194080ebe901ca12e6f6691aaf7d8ed6329dbcfdc2618"
    assert kvtier.block_keys([1, 2, 3], block_size=4) == []
    with pytest.raises(ValueError, match="unknown key scheme"):
        kvtier.block_keys([1], scheme="md5")


def test_help_documents_the_methods():
    doc = kvtier.Client.batch_get_into.__doc__
    assert "bytes read" in doc and "NOT_FOUND" in doc
    assert "NOT_FOUND" in kvtier.errors.describe(kvtier.errors.NOT_FOUND)


def test_tls_client_round_trip(tls_server):
    keys = [f"tls-{i}".encode() for i in range(4)]
    values = [pattern(k, 300_000) for k in keys]
    with kvtier.Client(tls_server["url"], auth_token=tls_server["token"], tls_ca=tls_server["ca"]) as c:
        assert c.batch_put_from(keys, values) == [0] * 4
        dest = [np.zeros(300_000, dtype=np.uint8) for _ in keys]
        assert c.batch_get_into(keys, dest) == [300_000] * 4
        for d, v in zip(dest, values):
            assert np.array_equal(d, v)
    with pytest.raises(kvtier.KvtierError, match="CA certificate"):
        kvtier.Client(tls_server["url"], auth_token=tls_server["token"], tls_ca=None)


def _layer_segments(base, layers, blocks, block_bytes):
    """Pointers and sizes per block across `layers` layer arrays of
    `blocks` blocks each, laid out [layer][block] from `base`."""
    ptrs = [[base + (layer * blocks + b) * block_bytes for layer in range(layers)] for b in range(blocks)]
    return ptrs, [[block_bytes] * layers for _ in range(blocks)]


def test_multi_buffers_gather_and_scatter(engine):
    layers, blocks, block_bytes = 5, 6, 4096 + 123
    keys = [unique("mb") for _ in range(blocks)]
    source = np.concatenate([pattern(k, layers * block_bytes) for k in keys]).reshape(blocks, layers, block_bytes)
    # The engine's layout: [layer][block]; kvtier stores block-major values.
    by_layer = np.ascontiguousarray(source.transpose(1, 0, 2))
    dest = np.zeros_like(by_layer)
    assert engine.register_buffer(by_layer) == 0
    assert engine.register_buffer(dest) == 0
    ptrs, sizes = _layer_segments(by_layer.ctypes.data, layers, blocks, block_bytes)
    assert engine.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
    # Each key's value is its block's pages, layer after layer.
    assert engine.get(keys[2]) == source[2].tobytes()
    dptrs, dsizes = _layer_segments(dest.ctypes.data, layers, blocks, block_bytes)
    assert engine.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_bytes] * blocks
    assert np.array_equal(dest, by_layer)
    # Per key: a miss, too little room, an unregistered segment.
    scratch = np.zeros(block_bytes, dtype=np.uint8)
    got = engine.batch_get_into_multi_buffers(
        [unique("miss"), keys[0], keys[1]],
        [dptrs[0], dptrs[1][:2], [dptrs[2][0], scratch.ctypes.data]],
        [dsizes[0], dsizes[1][:2], [block_bytes, block_bytes]],
    )
    assert got == [errors.NOT_FOUND, errors.BUFFER_TOO_SMALL, errors.INVALID_ARGUMENT]
    with pytest.raises(ValueError, match="overlap"):
        engine.batch_get_into_multi_buffers(keys[:2], [dptrs[0], dptrs[0]], [dsizes[0], dsizes[0]])
    with pytest.raises(ValueError, match="one size per pointer"):
        engine.batch_put_from_multi_buffers(keys[:1], [ptrs[0]], [sizes[0][:1]])
    assert engine.unregister_buffer(dest.ctypes.data) == 0
    assert engine.unregister_buffer(by_layer.ctypes.data) == 0


def test_multi_buffers_in_shared_memory_move_no_bytes_through_the_socket(server):
    layers, blocks, block_bytes = 4, 8, 16384
    with kvtier.Client(server["unix"], shm_size="8MiB") as c:
        buf = c.alloc_buffer(2 * layers * blocks * block_bytes)
        view = np.frombuffer(buf, dtype=np.uint8).reshape(2, layers, blocks, block_bytes)
        keys = [unique("shm-mb") for _ in range(blocks)]
        for b, k in enumerate(keys):
            view[0, :, b, :] = pattern(k, layers * block_bytes).reshape(layers, block_bytes)
        ptrs, sizes = _layer_segments(buf.ptr, layers, blocks, block_bytes)
        before = c.stats()["server"]
        assert c.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
        half = layers * blocks * block_bytes
        dptrs, dsizes = _layer_segments(buf.ptr + half, layers, blocks, block_bytes)
        assert c.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_bytes] * blocks
        assert np.array_equal(view[1], view[0])
        ops = c.stats()["server"]["ops"]
        assert ops["batch_put_shm_segments"]["requests"] >= 1, ops
        assert ops["batch_get_shm_segments"]["requests"] >= 1, ops
        assert ops["batch_put"]["requests"] == before["ops"]["batch_put"]["requests"]
