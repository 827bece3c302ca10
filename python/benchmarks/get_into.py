"""Python-side batch_get_into and batch_put_from throughput against
numpy.copyto, same bytes.

    python python/benchmarks/get_into.py unix:///path/kvtier.sock [value_mib] [batch] [rounds]

Puts `batch` values (memory only) into the server, then times
`batch_get_into` into a buffer from `Client.alloc_buffer` (the shared-memory
path) against `numpy.copyto` of the same number of bytes between two
pre-touched arrays, alternating the two; then the same for `batch_put_from`
out of the shared buffer (memory only, overwriting the same keys).
"""

import sys
import time
import uuid

import numpy as np

import kvtier

url = sys.argv[1]
value = int(sys.argv[2]) << 20 if len(sys.argv) > 2 else 16 << 20
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 20

with kvtier.Client(url, shm_size=2 * value * batch) as c:
    src = c.alloc_buffer(value * batch)
    dst = c.alloc_buffer(value * batch)
    srcv = np.frombuffer(src, dtype=np.uint8).reshape(batch, value)
    dstv = np.frombuffer(dst, dtype=np.uint8).reshape(batch, value)
    srcv[:] = np.random.default_rng(1).integers(1, 255, size=(batch, value), dtype=np.uint8)
    keys = [f"pybench-{uuid.uuid4().hex}-{i}" for i in range(batch)]
    assert c.batch_put_from(keys, list(srcv), memory_only=True) == [0] * batch
    a = np.empty(value * batch, dtype=np.uint8)
    a.fill(0)  # touch the pages before timing
    b = np.ones(value * batch, dtype=np.uint8)
    store_s, copy_s = 0.0, 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        got = c.batch_get_into(keys, list(dstv))
        store_s += time.perf_counter() - t
        assert got == [value] * batch
        t = time.perf_counter()
        np.copyto(a, b)
        copy_s += time.perf_counter() - t
    assert np.array_equal(dstv, srcv)
    total = value * batch * rounds
    print(f"batch_get_into {value >> 20} MiB x {batch}: {total / store_s / 1e6:.0f} MB/s; "
          f"numpy.copyto: {total / copy_s / 1e6:.0f} MB/s; ratio {copy_s / store_s:.2f}")
    store_s, copy_s = 0.0, 0.0
    for _ in range(rounds):
        t = time.perf_counter()
        assert c.batch_put_from(keys, list(srcv), memory_only=True) == [0] * batch
        store_s += time.perf_counter() - t
        t = time.perf_counter()
        np.copyto(a, b)
        copy_s += time.perf_counter() - t
    print(f"batch_put_from {value >> 20} MiB x {batch}: {total / store_s / 1e6:.0f} MB/s; "
          f"numpy.copyto: {total / copy_s / 1e6:.0f} MB/s; ratio {copy_s / store_s:.2f}")
    for k in keys:
        c.remove(k)
