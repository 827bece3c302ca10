"""The engine flow end to end: tokens -> block keys -> prefix_len ->
batch_get_into for the cached prefix -> "prefill" the rest ->
batch_put_from for the new blocks, with every byte verified.

    python examples/prefix_cache.py                         # embedded store in a temp dir
    python examples/prefix_cache.py unix:///path/kvtier.sock  # or tcp://127.0.0.1:7700
"""

import sys
import tempfile

import numpy as np

import kvtier

BLOCK_TOKENS = 256
BLOCK_BYTES = 256 * 1024  # KV bytes of one block (stand-in size)


def kv_for(key: bytes) -> np.ndarray:
    """Stand-in KV tensors for a block, derived from its key."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size=BLOCK_BYTES, dtype=np.uint8)


def serve_request(cache, tokens, host_pool):
    keys = kvtier.block_keys(tokens, block_size=BLOCK_TOKENS, salt=b"example-model")
    hit = cache.prefix_len(keys)
    if hit:
        slots = [host_pool[i] for i in range(hit)]
        got = cache.batch_get_into(keys[:hit], slots)
        hit = next((i for i, n in enumerate(got) if n != BLOCK_BYTES), hit)
        for i in range(hit):
            assert np.array_equal(host_pool[i], kv_for(keys[i])), "wrong bytes"
    # "Prefill" the blocks that were not cached, then store them.
    new = keys[hit:]
    for i, key in enumerate(new):
        host_pool[hit + i][:] = kv_for(key)
    if new:
        codes = cache.batch_put_from(new, [host_pool[hit + i] for i in range(len(new))])
        assert all(c == 0 for c in codes), codes
    return hit, len(keys)


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else None
    if target:
        cache = kvtier.Client(target, shm_size="64MiB")
        # On a Unix socket, place the host KV pool in shared memory: gets
        # and puts then move no bytes over the socket.
        pool = np.frombuffer(cache.alloc_buffer(32 * BLOCK_BYTES), dtype=np.uint8) if target.startswith("unix://") else np.zeros(32 * BLOCK_BYTES, dtype=np.uint8)
    else:
        # A scratch store; the directory is removed when the program exits.
        scratch = tempfile.TemporaryDirectory(prefix="kvtier-example-")
        cache = kvtier.Store(scratch.name, memory="64MiB", disk="1GiB")
        pool = np.zeros(32 * BLOCK_BYTES, dtype=np.uint8)
    host_pool = pool.reshape(32, BLOCK_BYTES)
    with cache:
        system_prompt = list(range(4 * BLOCK_TOKENS))
        for turn, user in enumerate([[7] * 2 * BLOCK_TOKENS, [9] * 3 * BLOCK_TOKENS, [7] * 2 * BLOCK_TOKENS]):
            hit, total = serve_request(cache, system_prompt + user, host_pool)
            print(f"request {turn}: {hit} of {total} blocks loaded from the cache, {total - hit} prefilled")
        cache.flush()
        print("ok:", {k: v for k, v in cache.stats().items() if k in ("entries", "memory_hits", "disk_hits")} if target is None else "served")


if __name__ == "__main__":
    main()
