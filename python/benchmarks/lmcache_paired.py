"""kvtier's LMCache plugin and LMCache's fs_native client driven in one
process, round by round in turn, as LMCache's ``NativeConnectorL2Adapter``
drives them: submit a batch with the objects' memoryviews, poll the
connector's eventfd, drain the completion. Run by ``lmcache_l2.py``
(``--paired-rounds``) beside ``lmcache bench l2``.

Why: the machine's copy bandwidth moves between an adapter's bench run and
the next (the memcpy ceiling measured before each repeat ranges 14-20 GB/s
here), and LMCache's bench runs each adapter on its own, one after the
other, so two adapters that copy the same bytes compare within that drift.
Here every store and load round of one alternates with one of the other
(ABBA order), so the drift falls on both alike.

The same work for both: objects of ``--data-size-kb`` in batches of
``--num-keys``; stores of fresh keys from one source buffer (kvtier: the
server reads each value from this process's memory into its pool,
checksummed, then flushes it to its region log on disk; fs_native: a file
per object through the page cache), loads into buffers zeroed before each
round (LMCache's bench zeroes its L1 buffers too), every loaded byte
compared with the source after the round, outside the timing, after one
untimed store round each. Store rounds
are as many as keep fs_native's files within the kernel's dirty-page
limits (as in LMCache's bench, whose runs each store a few hundred MiB):
past them its writes wait for the disk, which measures the disk instead.

Usage: python lmcache_paired.py KVTIER_BIN WORK_DIR NUM_KEYS DATA_SIZE_KB
STORE_ROUNDS LOAD_ROUNDS OUT_JSON (with LMCache and this repository's
``python`` directory on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import signal
import statistics
import subprocess
import sys
import time

KINDS = ("kvtier", "fs_native")


def round_trip(connector, kind: str, keys: list[str], views: list[memoryview]) -> float:
    """One batch through `connector` as LMCache's adapter drives it:
    microseconds from submit to the drained completion."""
    efd = connector.event_fd()
    submit = connector.submit_batch_set if kind == "set" else connector.submit_batch_get
    started = time.perf_counter_ns()
    future = submit(keys, views)
    done = []
    while not done:
        select.select([efd], [], [], 30.0)
        done = connector.drain_completions()
        if not done and time.perf_counter_ns() - started > 60e9:
            raise RuntimeError(f"{kind}: no completion within 60 s")
    took = (time.perf_counter_ns() - started) / 1000
    (got, ok, error, results), = done
    # A store's per-key results are optional (fs_native gives none).
    if got != future or not ok or (results is None and kind == "get") or not all(results or ()):
        raise RuntimeError(f"{kind}: completion {got} for {future}: ok={ok} {error!r} {results}")
    return took


def summary(times: list[float], nbytes: int) -> dict:
    times = sorted(times)
    p50 = statistics.median(times)
    return {"rounds": len(times), "p50_us": round(p50, 1), "p10_us": round(times[len(times) // 10], 1),
            "p90_us": round(times[(9 * len(times)) // 10], 1), "mb_s": round(nbytes / p50, 1)}


def main() -> None:
    binary, work, num_keys, size_kb, store_rounds, load_rounds, out = sys.argv[1:]
    work = pathlib.Path(work)
    num_keys, size, store_rounds, load_rounds = int(num_keys), int(size_kb) * 1024, int(store_rounds), int(load_rounds)
    import torch
    from kvtier.integrations.lmcache import KvtierL2Connector
    from lmcache.lmcache_fs import LMCacheFSClient

    data = work / "kvtier"
    server = subprocess.Popen([binary, "serve", "--data-dir", str(data), "--memory", "2GiB", "--disk", "8GiB",
                               "--listen", "off", "--admin", "off"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        if not line.startswith("kvtier serving"):
            raise RuntimeError(f"kvtier serve did not start: {line}")
        (work / "fs_native").mkdir()
        connectors = {
            # The bench's made-up model, pinned as lmcache_l2.py pins it.
            "kvtier": KvtierL2Connector(kvtier_url=f"unix://{data / 'kvtier.sock'}",
                                        model_fingerprints={"bench-model": "lmcache-bench"}),
            # LMCache's fs_native adapter with its defaults (4 workers, page cache).
            "fs_native": LMCacheFSClient(str(work / "fs_native"), 4, "", False, 0),
        }
        total = num_keys * size
        source = torch.randint(0, 256, (total,), dtype=torch.uint8)
        landing = torch.zeros(total, dtype=torch.uint8)
        sources = [memoryview(source.numpy())[i * size:(i + 1) * size] for i in range(num_keys)]
        dests = [memoryview(landing.numpy())[i * size:(i + 1) * size] for i in range(num_keys)]

        def keys() -> list[str]:
            return [f"bench-model@{i:x}@0@{os.urandom(16).hex()}" for i in range(num_keys)]

        def in_turn(r: int):
            return KINDS if r % 4 in (0, 3) else tuple(reversed(KINDS))

        # One untimed round each first (LMCache's bench warms up too): the
        # plugin connects to the model's namespace on its first batch.
        warm = keys()
        for kind in KINDS:
            round_trip(connectors[kind], "set", warm, sources)
        stores: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(store_rounds):
            fresh = keys()
            for kind in in_turn(r):
                stores[kind].append(round_trip(connectors[kind], "set", fresh, sources))
        # The keys the loads read: stored once by each, untimed.
        loaded = keys()
        for kind in KINDS:
            round_trip(connectors[kind], "set", loaded, sources)
        loads: dict[str, list[float]] = {k: [] for k in KINDS}
        for r in range(load_rounds):
            for kind in in_turn(r):
                landing.zero_()
                loads[kind].append(round_trip(connectors[kind], "get", loaded, dests))
                if not torch.equal(landing, source):
                    raise RuntimeError(f"{kind}: a load returned bytes that are not the stored ones")
        connectors["kvtier"].close()
        report = {"num_keys": num_keys, "data_size_kb": size // 1024,
                  "store": {k: summary(v, total) for k, v in stores.items()},
                  "load": {k: summary(v, total) for k, v in loads.items()}}
        for op in ("store", "load"):
            report[op]["kvtier_to_fs_native"] = round(
                report[op]["fs_native"]["p50_us"] / report[op]["kvtier"]["p50_us"], 3)
        pathlib.Path(out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
