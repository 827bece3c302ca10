"""What the model fingerprint costs (docs/integrations.md, "The model's
identity"): a checkpoint of safetensors shards written here with
non-repeating bytes (or an existing model directory), fingerprinted

- cold: page cache dropped (needs root: /proc/sys/vm/drop_caches), no
  fingerprint cache: every sampled byte comes from the disk;
- warm: the sampled bytes in the page cache, no fingerprint cache;
- cached: the fingerprint cache holding every file (what a restart of an
  engine on unchanged weights pays: a stat per file).

Medians of ``--runs`` runs; one JSON object on stdout.

    python python/benchmarks/fingerprint_cost.py --gib 8 --shards 4 --dir /var/tmp/fp-model
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import struct
import sys
import tempfile
import time

from kvtier.integrations import _fingerprint as fp


def write_checkpoint(root: pathlib.Path, gib: float, shards: int) -> int:
    """Shards of one F32 tensor each, filled with non-repeating bytes (a
    counter hashed per MiB) so nothing is sparse or compressible."""
    import hashlib

    root.mkdir(parents=True, exist_ok=True)
    per_shard = int(gib * (1 << 30)) // shards // (1 << 20) * (1 << 20)
    for n in range(shards):
        path = root / f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        if path.exists() and path.stat().st_size > per_shard:
            continue
        header = json.dumps({"w": {"dtype": "F32", "shape": [per_shard // 4], "data_offsets": [0, per_shard]}})
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header.encode())
            seed = hashlib.sha256(f"shard-{n}".encode()).digest()
            block = (seed * ((1 << 20) // len(seed)))
            for mib in range(per_shard >> 20):
                # Cheap but distinct per MiB: the first 32 bytes name the MiB.
                f.write(hashlib.sha256(seed + mib.to_bytes(8, "little")).digest() + block[32:])
    (root / "config.json").write_text('{"model_type": "llama"}')
    return sum(p.stat().st_size for p in root.glob("*.safetensors"))


def drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(root: pathlib.Path) -> float:
    start = time.perf_counter()
    fp.weights_fingerprint(root)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="checkpoint size to write (default 8)")
    parser.add_argument("--shards", type=int, default=4, help="safetensors files (default 4)")
    parser.add_argument("--dir", help="where the checkpoint is written or already lies (default: a temporary one)")
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement (default 3)")
    args = parser.parse_args()

    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="kvtier-fp-")) / "model"
    total = write_checkpoint(root, args.gib, args.shards)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvtier-fp-cache-"))

    os.environ[fp.CACHE_ENV] = "off"
    cold, cold_measured = [], True
    for _ in range(args.runs):
        cold_measured = drop_page_cache() and cold_measured
        cold.append(timed(root))
    warm = [timed(root) for _ in range(args.runs)]
    os.environ[fp.CACHE_ENV] = str(scratch / "fingerprints.json")
    timed(root)  # fills the cache
    cached = [timed(root) for _ in range(args.runs)]
    files = len(list(root.glob("*.safetensors")))
    print(json.dumps({
        "checkpoint_bytes": total,
        "files": files,
        "read_per_file_bytes": fp.SAMPLES * fp.SAMPLE_BYTES,
        "cold_seconds_median": statistics.median(cold) if cold_measured else None,
        "cold_note": "page cache dropped before each run" if cold_measured
        else "not measured: dropping the page cache needs root",
        "warm_seconds_median": statistics.median(warm),
        "cached_seconds_median": statistics.median(cached),
        "runs": args.runs,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
