"""How the vLLM secondary tier should move chunks between vLLM's primary
region and kvtier: straight through the server's Unix socket (what
`kvtier.integrations.vllm_tier` does), or staged through kvtier shared
memory (one memcpy on the client, the server then reads and writes the
shared memory directly). Same process, same server, alternating rounds.

    python python/benchmarks/vllm_tier_copy.py unix:///path/kvtier.sock [--chunk 2MiB] [--batch 16]

Prints MB/s per path and direction (medians of the rounds) as JSON. The
primary region here is an anonymous mmap of the chunk rows, as vLLM's is a
/dev/shm mmap.
"""

import argparse
import json
import mmap
import os
import statistics
import time

import numpy as np

from kvtier import Client


def size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--chunk", default="2MiB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    chunk, batch = size(args.chunk), args.batch
    region = mmap.mmap(-1, chunk * batch)
    rows = np.frombuffer(region, dtype=np.uint8).reshape(batch, chunk)
    rows[:] = np.frombuffer(os.urandom(chunk * batch), dtype=np.uint8).reshape(batch, chunk)
    flat = memoryview(region)
    views = [flat[i * chunk:(i + 1) * chunk] for i in range(batch)]
    client = Client(args.url, namespace=f"bench/vllm-tier-copy/{os.getpid()}", shm_size=chunk * batch)
    staging = client.alloc_buffer(chunk * batch)
    stage = np.frombuffer(staging, dtype=np.uint8).reshape(batch, chunk)
    ptrs = [staging.ptr + i * chunk for i in range(batch)]
    sizes = [chunk] * batch
    rates: dict[str, list[float]] = {k: [] for k in ("socket_put", "socket_get", "staged_put", "staged_get")}
    expected = rows.copy()
    for r in range(args.rounds):
        for path in ("socket", "staged") if r % 2 == 0 else ("staged", "socket"):
            keys = [f"{path}-{r}-{i}".encode() for i in range(batch)]
            started = time.perf_counter()
            if path == "socket":
                codes = client.batch_put_from(keys, views)
            else:
                stage[:] = rows
                codes = client.batch_put_from(keys, ptrs, sizes)
            put_s = time.perf_counter() - started
            assert codes == [0] * batch, codes
            rows[:] = 0
            started = time.perf_counter()
            if path == "socket":
                got = client.batch_get_into(keys, views)
            else:
                got = client.batch_get_into(keys, ptrs, sizes)
                rows[:] = stage
            get_s = time.perf_counter() - started
            assert got == [chunk] * batch, got
            assert np.array_equal(rows, expected), f"{path}: bytes differ"
            for k in keys:
                client.remove(k)
            rates[f"{path}_put"].append(chunk * batch / put_s / 1e6)
            rates[f"{path}_get"].append(chunk * batch / get_s / 1e6)
    medians = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    medians.update(chunk=chunk, batch=batch, rounds=args.rounds,
                   staged_over_socket_put=round(medians["staged_put"] / medians["socket_put"], 2),
                   staged_over_socket_get=round(medians["staged_get"] / medians["socket_get"], 2))
    print(json.dumps(medians))
    client.close()


if __name__ == "__main__":
    main()
