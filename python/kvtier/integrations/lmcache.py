"""kvtier as an L2 tier of LMCache's server (MP mode), through LMCache's
``native_plugin`` adapter. Configure it by LMCache's own L2 adapter config::

    {"type": "native_plugin",
     "module_path": "kvtier.integrations.lmcache",
     "class_name": "KvtierL2Connector",
     "adapter_params": {"kvtier_url": "unix:///run/kvtier/kvtier.sock"}}

LMCache's ``NativeConnectorL2Adapter`` drives the object: it submits batch
``exists`` / ``get`` / ``set`` / ``delete`` calls that return a future id at
once, waits on one eventfd, and drains ``(future_id, ok, error,
per-key results)`` completions. Loads and stores run in kvtier's native
code from submit to completion (``*_async`` with ``notify_fd``): the server
reads and writes LMCache's L1 buffers directly (cross-memory transfers on
the Unix socket: one copy each way, see docs/server.md), and the eventfd is
written with no Python thread and no GIL in between, so a busy LMCache
event loop delays no completion. Lookups and deletes run on a small thread
pool. LMCache's event loop never blocks on kvtier.

Keys: LMCache names an object ``model@rank@group@chunk_hash[@salt]``; every
model gets its own kvtier namespace (``[prefix/]lmcache/<kind>/<digest>``,
the digest over the model's fingerprint: its weights and config.json, read
from the directory or Hugging Face cache the name leads to, or the
operator's pin in ``model_fingerprints``; a model that is neither is
refused, never cached under its bare name), and the key inside it is the
rank, the group, the chunk hash and the salt. (Not a
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
import functools
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import KvtierError, errors
from ._common import FailedKeys, connect, model_label, namespace_for, read_config_json, resolve_url
from ._common import namespace_prefix as namespace_prefix_of
from ._fingerprint import FingerprintError, locate_weights, model_fingerprint

logger = logging.getLogger("kvtier.lmcache")

# Distinct model namespaces kept connected at once; the least recently
# used beyond this is closed (and reopened when used again).
MAX_NAMESPACES = 16
# Most keys one submitted batch may carry (LMCache batches by request; a
# larger batch is refused rather than buffered without bound).
MAX_BATCH_KEYS = 65536
# kvtier's key limit (crates/kvtier/src/key.rs MAX_KEY_LEN).
MAX_KEY_LEN = 256
# LMCache object keys whose parse is remembered: LMCache looks a key up
# before it loads it, and a 32-key batch parsed afresh costs 40-80 us of
# a 2 ms load. About 300 bytes each (the key, its parse), so 4.9 MB at most.
PARSED_KEYS = 16384


class KvtierL2Connector:
    """LMCache's native-plugin connector interface over a kvtier server."""

    def __init__(
        self,
        kvtier_url: str | None = None,
        workers: int = 4,
        timeout: float = 30.0,
        model_fingerprints: dict[str, str] | None = None,
        namespace_prefix: str | None = None,
        **unknown: Any,
    ):
        if unknown:
            raise ValueError(f"kvtier lmcache: unknown adapter_params {sorted(unknown)} "
                             "(known: kvtier_url, workers, timeout, model_fingerprints, namespace_prefix)")
        pins = model_fingerprints or {}
        if not isinstance(pins, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pins.items()):
            raise ValueError("kvtier lmcache: model_fingerprints maps LMCache model names to fingerprints (strings)")
        self.pins = dict(pins)
        self._pinned: dict[str, str] = {}
        self.prefix = namespace_prefix_of(namespace_prefix)
        if not 1 <= int(workers) <= 64:
            raise ValueError("kvtier lmcache: workers must be between 1 and 64")
        self.url = resolve_url(kvtier_url)
        self.timeout = float(timeout)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, Any] = OrderedDict()
        self._completions: list[tuple[int, bool, str, list[bool] | None]] = []
        # Loads and stores in flight in kvtier's native code, by future id:
        # (kind, keys, [(indices, buffers, pending call)]).
        self._in_flight: dict[int, tuple[str, list[str], list]] = {}
        self._next_id = 1
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=int(workers), thread_name_prefix="kvtier-lmcache")
        self.counters = {"gets": 0, "hits": 0, "sets": 0, "stored": 0, "exists": 0, "deletes": 0, "errors": 0}
        # Objects whose load failed: absent to lookups until stored again.
        self._failed = FailedKeys()
        # Fail at startup, not at the first request, when no server answers.
        connect(
            self.url, namespace_for("lmcache", {"probe": True}, self.prefix), timeout=self.timeout, describe=False
        ).close()

    # The interface LMCache's NativeConnectorL2Adapter calls.

    def event_fd(self) -> int:
        return self._efd

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._submit(self._exists, keys, None)

    def submit_batch_get(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit_native("get", keys, memoryviews)

    def submit_batch_set(self, keys: list[str], memoryviews: list[memoryview]) -> int:
        return self._submit_native("set", keys, memoryviews)

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit(self._delete, keys, None)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._lock:
            finished = [f for f, (_, _, calls) in self._in_flight.items() if all(c[2].done() for c in calls)]
            native = [(f, self._in_flight.pop(f)) for f in finished]
        done = [self._finish(f, kind, keys, calls) for f, (kind, keys, calls) in native]
        with self._lock:
            done, self._completions = self._completions + done, []
        return done

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            in_flight = [c[2] for _, _, calls in self._in_flight.values() for c in calls]
        self._pool.shutdown(wait=True)
        # Their threads write the eventfd when done: it stays open till then.
        for pending in in_flight:
            try:
                pending.wait()
            except KvtierError:
                pass
        with self._lock:
            clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            client.close()
        os.close(self._efd)

    # Calls.

    def _future_id(self, keys: list[str], views: list[memoryview] | None) -> int:
        """A new future id for a batch whose size and buffers are checked."""
        if len(keys) > MAX_BATCH_KEYS:
            raise ValueError(f"kvtier lmcache: a batch of {len(keys)} keys is over the {MAX_BATCH_KEYS} limit")
        if views is not None and len(views) != len(keys):
            raise ValueError(f"kvtier lmcache: {len(keys)} keys but {len(views)} buffers")
        with self._lock:
            if self._closed:
                raise RuntimeError("kvtier lmcache: the connector is closed")
            future_id = self._next_id
            self._next_id += 1
        return future_id

    def _submit(self, work, keys: list[str], views: list[memoryview] | None) -> int:
        future_id = self._future_id(keys, views)
        self._pool.submit(self._run, future_id, work, keys, views)
        return future_id

    def _submit_native(self, kind: str, keys: list[str], views: list[memoryview]) -> int:
        """A load or store started in kvtier's native code, which writes the
        eventfd when it is done; a batch that cannot start (a key that is
        not LMCache's, a model with no namespace) completes failed at once."""
        future_id = self._future_id(keys, views)
        calls = []
        try:
            for client, indices, inner in self._by_namespace(keys):
                buffers = [views[i] for i in indices]
                if kind == "get":
                    calls.append((indices, buffers, client.batch_get_into_async(inner, buffers, notify_fd=self._efd)))
                    continue
                # Objects whose load failed replace what is stored; the
                # others are skipped where present (one call, or two).
                replace = self._failed.take([keys[i] for i in indices])
                for overwrite in (False, True):
                    picked = [n for n, r in enumerate(replace) if r == overwrite]
                    if picked:
                        pending = client.batch_put_from_async(
                            [inner[n] for n in picked], [buffers[n] for n in picked],
                            skip_existing=not overwrite, notify_fd=self._efd)
                        calls.append(([indices[n] for n in picked], None, pending))
        except Exception as e:  # noqa: BLE001 - a batch that cannot start is a failed completion, never a lost future
            self._fail(future_id, kind, keys, e, calls)
            return future_id
        with self._lock:
            self._in_flight[future_id] = (kind, keys, calls)
        # A call that ended before it was listed here may have had its
        # eventfd write drained already: one more wakes the loop for it.
        if any(pending.done() for _, _, pending in calls):
            os.eventfd_write(self._efd, 1)
        return future_id

    def _fail(self, future_id: int, kind: str, keys: list[str], e: Exception, started: list) -> None:
        for _, _, pending in started:
            try:
                pending.wait()
            except KvtierError:
                pass
        with self._lock:
            self.counters["errors"] += 1
            self._completions.append((future_id, False, str(e), [False] * len(keys)))
        logger.warning("kvtier lmcache: %s of %d keys failed: %s", kind, len(keys), e)
        os.eventfd_write(self._efd, 1)

    def _finish(self, future_id: int, kind: str, keys: list[str], calls: list) -> tuple[int, bool, str, list[bool]]:
        """The completion of a finished native load or store."""
        out = [False] * len(keys)
        try:
            for indices, buffers, pending in calls:
                results = pending.wait()
                if kind == "get":
                    for i, got, buffer in zip(indices, results, buffers):
                        out[i] = got == buffer.nbytes
                else:
                    for i, code in zip(indices, results):
                        out[i] = code == errors.OK
        except KvtierError as e:
            with self._lock:
                self.counters["errors"] += 1
            # The call did not reach the server (it is away): misses, not
            # wrong values, so nothing is held back from lookups.
            logger.warning("kvtier lmcache: %s of %d keys failed: %s", kind, len(keys), e)
            return (future_id, False, str(e), [False] * len(keys))
        with self._lock:
            if kind == "get":
                self.counters["gets"] += len(keys)
                self.counters["hits"] += sum(out)
            else:
                self.counters["sets"] += len(keys)
                self.counters["stored"] += sum(out)
        if kind == "get":
            self._failed.add(k for k, good in zip(keys, out) if not good)
            return (future_id, True, "", out)
        # A store is ok only if every value was stored (LMCache accounts a
        # store's bytes only then).
        return (future_id, all(out), "", out)

    def _run(self, future_id: int, work, keys: list[str], views) -> None:
        try:
            # A lookup or delete that ran is ok, its misses in the per-key
            # results.
            completion = (future_id, True, "", work(keys, views))
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
        """The client of the model's namespace. The namespace is worked out
        on every batch (the weights' digests come from the fingerprint
        cache while the files are unchanged): a model updated in place
        under the same name moves to a new namespace at once, though this
        long-lived server saw the old one."""
        namespace = self._namespace(model)
        with self._lock:
            client = self._clients.get(namespace)
            if client is not None:
                self._clients.move_to_end(namespace)
                return client
        # No shared buffer: values move between LMCache's L1 and the server by
        # cross-memory transfers (or the socket where the server cannot reach
        # this process), never through a buffer of the client's.
        client = connect(self.url, namespace, shm_size=0, timeout=self.timeout)
        with self._lock:
            if namespace in self._clients:  # another thread connected meanwhile
                client.close()
                return self._clients[namespace]
            self._clients[namespace] = client
            while len(self._clients) > MAX_NAMESPACES:
                _, old = self._clients.popitem(last=False)
                old.close()
        return client

    def _namespace(self, model: str) -> str:
        """The model's namespace, by its fingerprint; raises (the batch
        fails, LMCache recomputes) for a model whose weights are not here
        and that has no pin."""
        pin = self.pins.get(model)
        if pin is not None:
            # The operator's name for the model stands for all of it (its
            # files need not be here): worked out once.
            known = self._pinned.get(model)
            if known is None:
                fingerprint = model_fingerprint(model, None, {}, pin, engine="LMCache")
                known = namespace_for("lmcache", {"label": "pinned", "fingerprint": fingerprint}, self.prefix)
                self._pinned[model] = known
            return known
        try:
            config = _config_json(model)
            fingerprint = model_fingerprint(model, None, {"config.json": config}, None, engine="LMCache")
        except FingerprintError as e:
            raise KvtierError(f"kvtier lmcache: model {model!r}: {e} (adapter_params model_fingerprints)") from None
        return namespace_for("lmcache", {"label": model_label(config), "fingerprint": fingerprint}, self.prefix)

    def _exists(self, keys: list[str], _views) -> list[bool]:
        out = [False] * len(keys)
        for client, indices, inner in self._by_namespace(keys):
            failed = self._failed.known([keys[i] for i in indices])
            for i, code, bad in zip(indices, client.batch_is_exist(inner), failed):
                out[i] = code == 1 and not bad
        with self._lock:
            self.counters["exists"] += len(keys)
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
            return dict(self.counters, failed_held_back=len(self._failed), failed_replaced=self._failed.replaced)


@functools.lru_cache(maxsize=PARSED_KEYS)
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


def _config_json(model: str) -> dict | None:
    """The model's config.json where its weights are (LMCache's key names
    the model; its engine's overrides are not visible here: pin
    ``model_fingerprints`` when they matter)."""
    try:
        return read_config_json(locate_weights(model))
    except FingerprintError:
        return None
