"""What the engine integrations share: where the server is, how to reach it,
and the namespace that keeps incompatible engines' blocks apart."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .._native import Client, KvtierError

# The README's first command serves this socket, relative to the directory
# it was started in (./kvtier-data/kvtier.sock).
DEFAULT_URL = "unix://kvtier-data/kvtier.sock"

# Bumped whenever the bytes a connector stores for a block change meaning
# (value layout, what a key names): old blocks then simply miss.
VALUE_FORMAT = 1


def resolve_url(configured: str | None) -> str:
    """The server URL: the engine config's ``kvtier_url``, else the
    ``KVTIER_URL`` environment variable, else ``DEFAULT_URL``; relative Unix
    socket paths are made absolute against the current directory."""
    url = configured or os.environ.get("KVTIER_URL") or DEFAULT_URL
    if url.startswith("unix://"):
        path = url[len("unix://"):]
        url = "unix://" + os.path.abspath(path)
    return url


def connect(url: str, namespace: str, *, shm_size: int | str | None = None, timeout: float = 60.0) -> Client:
    """A client in ``namespace``; raises ``RuntimeError`` naming the server
    when none answers (the engine should not start silently cacheless)."""
    try:
        return Client(url, namespace=namespace, shm_size=shm_size, timeout=timeout)
    except (KvtierError, OSError, ValueError) as e:
        raise RuntimeError(
            f"kvtier: no kvtier server answers at {url} ({e}). Start one beside the engine "
            "(`kvtier serve --data-dir DIR`; see docs/integrations.md) and point the engine at it "
            "with the `kvtier_url` config key or the KVTIER_URL environment variable "
            f"(default {DEFAULT_URL}); set KVTIER_AUTH_TOKEN if it listens on TCP."
        ) from e


def namespace_for(engine: str, fields: dict[str, Any]) -> str:
    """A namespace naming everything that makes two engines' blocks
    incompatible. Readable where it fits (engine, model, dtype, rank), with
    a digest of every field so that no two different configurations meet
    even when the readable part is cut to the 128-byte limit."""
    described = dict(fields, engine=engine, value_format=VALUE_FORMAT)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:24]
    model = str(fields.get("model", "")).rstrip("/").rsplit("/", 1)[-1][:40]
    readable = "/".join(
        str(part)
        for part in (engine, model, fields.get("dtype", ""), fields.get("rank", ""))
        if part != ""
    )
    return f"{readable[:96]}/{digest}"


def staging_segments(
    base: int, segment_offsets: list[int], slot_stride: int, sizes: list[int], count: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Pointers and sizes of ``count`` values staged in one shared buffer,
    each value gathered from segments (a block's layers, or its K and V
    parts): segment ``k`` of slot ``i`` lies at ``base + segment_offsets[k]
    + i * slot_stride`` and holds ``sizes[k]`` bytes. The layout both engine
    integrations stage blocks in, for the multi-buffer calls."""
    ptrs = [[base + offset + i * slot_stride for offset in segment_offsets] for i in range(count)]
    return ptrs, [list(sizes) for _ in range(count)]
