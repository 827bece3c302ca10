"""kvtier as an L2 tier of LMCache's server (MP mode), through LMCache's
``native_plugin`` adapter. Configure it by LMCache's own L2 adapter config::

    {"type": "native_plugin",
     "module_path": "kvtier.integrations.lmcache",
     "class_name": "KvtierL2Connector",
     "adapter_params": {"kvtier_url": "unix:///run/kvtier/kvtier.sock"}}

LMCache's ``NativeConnectorL2Adapter`` drives the object: it submits batch
``exists`` / ``get`` / ``set`` / ``delete`` calls that return a future id at
once, waits on one eventfd, and drains ``(future_id, ok, error,
per-key results)`` completions. Here each call runs on a small thread pool
(kvtier's calls release the GIL while the server works) and writes the
eventfd when it is done, so LMCache's event loop never blocks on kvtier.

Keys: LMCache names an object ``model@rank@group@chunk_hash[@salt]``; every
model gets its own kvtier namespace (``lmcache/<model>/<digest>``), and the
key inside it is the rank, the group, the chunk hash and the salt. (Not a
namespace per rank: a namespace is a connection, and LMCache's own
``bench l2`` gives every key its own rank.) Values are the object's bytes as LMCache's L1
holds them; a load succeeds only when the stored value has exactly the
object's size (kvtier verifies every byte it returns).

A restarted kvtier server is transparent: a call that finds it away fails
(LMCache counts a miss and recomputes or keeps its L1 copy), and the next
call reconnects; blocks the server had flushed are still there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import KvtierError, errors
from ._common import connect, namespace_for, resolve_url

logger = logging.getLogger("kvtier.lmcache")

# Distinct model namespaces kept connected at once; the least recently
# used beyond this is closed (and reopened when used again).
MAX_NAMESPACES = 16
# Most keys one submitted batch may carry (LMCache batches by request; a
# larger batch is refused rather than buffered without bound).
MAX_BATCH_KEYS = 65536
# kvtier's key limit (crates/kvtier/src/key.rs MAX_KEY_LEN).
MAX_KEY_LEN = 256


class KvtierL2Connector:
    """LMCache's native-plugin connector interface over a kvtier server."""

    def __init__(self, kvtier_url: str | None = None, workers: int = 4, timeout: float = 30.0, **unknown: Any):
        if unknown:
            raise ValueError(f"kvtier lmcache: unknown adapter_params {sorted(unknown)} "
                             "(known: kvtier_url, workers, timeout)")
        if not 1 <= int(workers) <= 64:
            raise ValueError("kvtier lmcache: workers must be between 1 and 64")
        self.url = resolve_url(kvtier_url)
        self.timeout = float(timeout)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, Any] = OrderedDict()
        self._completions: list[tuple[int, bool, str, list[bool] | None]] = []
        self._next_id = 1
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="kvtier-lmcache")
        self.counters = {"gets": 0, "hits": 0, "sets": 0, "stored": 0, "exists": 0, "deletes": 0, "errors": 0}
        # Fail at startup, not at the first request, when no server answers.
        connect(self.url, namespace_for("lmcache", {"probe": True}), timeout=self.timeout).close()

    # The interface LMCache's NativeConnectorL2Adapter calls.

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(self._exists, keys, None)

    def submit_batch_get(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit(self._get, keys, memoryviews)

    def submit_batch_set(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit(self._set, keys, memoryviews)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit(self._delete, keys, None)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            done, self._completions = self._completions, []
        return done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            client.close()
        os.close(self._efd)

    # Calls.

    def _submit(self, work, keys: list[str], views: list[memoryview] | None) -> int:
        if len(keys) > MAX_BATCH_KEYS:
            raise ValueError(f"kvtier lmcache: a batch of {len(keys)} keys is over the {MAX_BATCH_KEYS} limit")
        if views is not None and len(views) != len(keys):
            raise ValueError(f"kvtier lmcache: {len(keys)} keys but {len(views)} buffers")
        with self._lock:
            if self._closed:
                raise RuntimeError("kvtier lmcache: the connector is closed")
            future_id = self._next_id
            self._next_id += 1
        self._pool.submit(self._run, future_id, work, keys, views)
        return future_id

    def _run(self, future_id: int, work, keys: list[str], views) -> None:
        try:
            results = work(keys, views)
            # "ok" is the call's: a lookup or load that ran is ok with its
            # misses in the per-key results; a store is ok only if every
            # value was stored (LMCache accounts a store's bytes only then).
            ok = all(results) if work == self._set else True
            completion = (future_id, ok, "", results)
        except Exception as e:  # noqa: BLE001 - every failure is a completion LMCache sees, never a lost future
            with self._lock:
                self.counters["errors"] += 1
            logger.warning("kvtier lmcache: %s of %d keys failed: %s", work.__name__.strip("_"), len(keys), e)
            completion = (future_id, False, str(e), [False] * len(keys))
        with self._lock:
            self._completions.append(completion)
            closed = self._closed
        if not closed:
            os.eventfd_write(self._efd, 1)

    def _by_namespace(self, keys: list[str]):
        """Keys grouped by their model's client: (client, indices, kvtier
        keys) per model."""
        groups: dict[str, tuple[list[int], list[bytes]]] = {}
        for i, key in enumerate(keys):
            model, rest = _parse(key)
            indices, inner = groups.setdefault(model, ([], []))
            indices.append(i)
            inner.append(rest)
        return [(self._client(model), indices, inner) for model, (indices, inner) in groups.items()]

    def _client(self, model: str):
        with self._lock:
            client = self._clients.get(model)
            if client is not None:
                self._clients.move_to_end(model)
                return client
        client = connect(self.url, namespace_for("lmcache", {"model": model}), timeout=self.timeout)
        with self._lock:
            if model in self._clients:  # another thread connected meanwhile
                client.close()
                return self._clients[model]
            self._clients[model] = client
            while len(self._clients) > MAX_NAMESPACES:
                _, old = self._clients.popitem(last=False)
                old.close()
        return client

    def _exists(self, keys: list[str], _views) -> list[bool]:
        out = [False] * len(keys)
        for client, indices, inner in self._by_namespace(keys):
            for i, code in zip(indices, client.batch_is_exist(inner)):
                out[i] = code == 1
        with self._lock:
            self.counters["exists"] += len(keys)
        return out

    def _get(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        out = [False] * len(keys)
        for client, indices, inner in self._by_namespace(keys):
            buffers = [views[i] for i in indices]
            for i, got, buffer in zip(indices, client.batch_get_into(inner, buffers), buffers):
                out[i] = got == buffer.nbytes
        with self._lock:
            self.counters["gets"] += len(keys)
            self.counters["hits"] += sum(out)
        return out

    def _set(self, keys: list[str], views: list[memoryview]) -> list[bool]:
        out = [False] * len(keys)
        for client, indices, inner in self._by_namespace(keys):
            codes = client.batch_put_from(inner, [views[i] for i in indices], skip_existing=True)
            for i, code in zip(indices, codes):
                out[i] = code == errors.OK
        with self._lock:
            self.counters["sets"] += len(keys)
            self.counters["stored"] += sum(out)
        return out

    def _delete(self, keys: list[str], _views) -> list[bool]:
        out = [False] * len(keys)
        for client, indices, inner in self._by_namespace(keys):
            for i, key in zip(indices, inner):
                try:
                    out[i] = client.remove(key) == 0
                except KvtierError:
                    out[i] = False
        with self._lock:
            self.counters["deletes"] += sum(out)
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)


def _parse(key: str) -> tuple[str, bytes]:
    """LMCache's ``model@rank_hex@group_hex@chunk_hash_hex[@salt]`` as
    (model, the key inside the model's namespace)."""
    parts = key.split("@")
    if len(parts) not in (4, 5):
        raise ValueError(f"kvtier lmcache: not an LMCache object key: {key[:200]!r}")
    model, rank_hex, group_hex, chunk_hex = parts[:4]
    salt = parts[4] if len(parts) == 5 else ""
    try:
        rank, group, chunk = int(rank_hex, 16), int(group_hex, 16), bytes.fromhex(chunk_hex)
    except ValueError as e:
        raise ValueError(f"kvtier lmcache: malformed LMCache object key {key[:200]!r}: {e}") from None
    # Fixed-width rank and group, a length-prefixed hash, then the salt: no
    # two (rank, group, hash, salt) tuples share bytes.
    salt_bytes = salt.encode()
    if len(chunk) > 255 or 9 + len(chunk) + len(salt_bytes) > MAX_KEY_LEN:
        raise ValueError(f"kvtier lmcache: key {key[:200]!r} is longer than kvtier keys may be ({MAX_KEY_LEN} bytes)")
    if not 0 <= group < 1 << 32 or not 0 <= rank < 1 << 32:
        raise ValueError(f"kvtier lmcache: malformed LMCache object key {key[:200]!r}: group or rank out of range")
    inner = rank.to_bytes(4, "big") + group.to_bytes(4, "big") + len(chunk).to_bytes(1, "big") + chunk + salt_bytes
    return model, inner
