"""What the engine integrations share: where the server is, how to reach it,
and the namespace that keeps incompatible engines' blocks apart."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from .._native import Client, KvtierError

logger = logging.getLogger("kvtier")

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


def connect(
    url: str,
    namespace: str,
    *,
    shm_size: int | str | None = None,
    timeout: float = 60.0,
    describe: bool = True,
) -> Client:
    """A client in ``namespace``; raises ``RuntimeError`` naming the server
    when none answers (the engine should not start silently cacheless).
    With ``describe``, the namespace's manifest (the fields
    ``namespace_for`` hashed into its name) is stored on the server, so an
    operator's ``kvtier namespaces list`` says what the digest stands for;
    a server that cannot store it (an older one) costs a warning only."""
    try:
        client = Client(url, namespace=namespace, shm_size=shm_size, timeout=timeout)
    except (KvtierError, OSError, ValueError) as e:
        raise RuntimeError(
            f"kvtier: no kvtier server answers at {url} ({e}). Start one beside the engine "
            "(`kvtier serve --data-dir DIR`; see docs/integrations.md) and point the engine at it "
            "with the `kvtier_url` config key or the KVTIER_URL environment variable "
            f"(default {DEFAULT_URL}); set KVTIER_AUTH_TOKEN if it listens on TCP."
        ) from e
    manifest = _MANIFESTS.get(namespace) if describe else None
    if manifest is not None:
        try:
            client.describe_namespace(manifest)
        except (KvtierError, OSError, ValueError) as e:
            logger.warning("kvtier: could not store the manifest of namespace %s: %s", namespace, e)
    return client


# The manifest of each namespace ``namespace_for`` made in this process
# (JSON text), for ``connect`` to store: at most this many are kept.
_MANIFESTS: OrderedDict[str, str] = OrderedDict()
_MAX_MANIFESTS = 1024
# Below the server's 16 KiB, leaving room for its timestamps.
_MAX_MANIFEST_BYTES = 12 * 1024


def _manifest_text(described: dict[str, Any]) -> str:
    """The manifest of a namespace: its fields as JSON; a field too long to
    keep (a large override, say) is replaced by its SHA-256, so the
    manifest always fits."""
    text = json.dumps(described, sort_keys=True, default=str)
    if len(text.encode()) <= _MAX_MANIFEST_BYTES:
        return text
    shortened = {}
    for name, value in described.items():
        one = json.dumps(value, sort_keys=True, default=str)
        shortened[name] = value if len(one) <= 256 else "sha256:" + hashlib.sha256(one.encode()).hexdigest()
    text = json.dumps(shortened, sort_keys=True, default=str)
    if len(text.encode()) <= _MAX_MANIFEST_BYTES:
        return text
    # Too many fields even so: the readable ones and a digest of the rest,
    # still a whole JSON object (a cut string would not parse).
    kept = {k: shortened[k] for k in ("engine", "label", "dtype", "rank", "fingerprint") if k in shortened}
    kept["fields_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    return json.dumps(kept, sort_keys=True, default=str)


# The server's limit on a namespace's length (bytes of UTF-8).
MAX_NAMESPACE_BYTES = 128
# The digest part of a namespace: 24 hex characters (96 bits).
DIGEST_CHARS = 24


def namespace_prefix(configured: Any) -> str:
    """A deployment's namespace prefix (a tenant's, with ``--tenants``):
    ``/``-separated components, none empty, no surrounding ``/``; ``""``
    when none is set. Raises ``ValueError`` for one that cannot be used."""
    if configured is None or configured == "":
        return ""
    if not isinstance(configured, str):
        raise ValueError(f"kvtier: namespace_prefix must be a string, not {type(configured).__name__}")
    prefix = configured.strip("/")
    if not prefix or any(part == "" for part in prefix.split("/")):
        raise ValueError(f"kvtier: namespace_prefix {configured!r} has an empty component")
    room = MAX_NAMESPACE_BYTES - DIGEST_CHARS - 2
    if len(prefix.encode()) > room:
        raise ValueError(
            f"kvtier: namespace_prefix {configured!r} is {len(prefix.encode())} bytes; at most {room} fit "
            f"in a {MAX_NAMESPACE_BYTES}-byte namespace beside the configuration's digest"
        )
    return prefix


def namespace_for(engine: str, fields: dict[str, Any], prefix: str = "") -> str:
    """A namespace naming everything that makes two engines' blocks
    incompatible: ``[prefix/]readable/digest``. The digest covers every
    field (the model's fingerprint among them), so no two different
    configurations meet; the readable part (engine, model kind, dtype,
    rank) is cut to what fits in the server's 128 bytes after the prefix,
    which is kept whole (a tenant's token covers only namespaces within
    its prefix)."""
    described = dict(fields, engine=engine, value_format=VALUE_FORMAT)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:DIGEST_CHARS]
    readable = "/".join(
        str(part).replace("/", "_")
        for part in (engine, fields.get("label", ""), fields.get("dtype", ""), fields.get("rank", ""))
        if part not in ("", None)
    )
    head = f"{prefix}/" if prefix else ""
    room = MAX_NAMESPACE_BYTES - len(head.encode()) - DIGEST_CHARS - 1
    cut = readable.encode()[: max(room, 0)].decode(errors="ignore").rstrip("/")
    name = f"{head}{cut}/{digest}" if cut else f"{head}{digest}"
    _MANIFESTS[name] = _manifest_text(described)
    _MANIFESTS.move_to_end(name)
    while len(_MANIFESTS) > _MAX_MANIFESTS:
        _MANIFESTS.popitem(last=False)
    return name


def model_label(config: Any) -> str:
    """A short readable name of a model's kind (``llama``), from its
    configuration (an object, a config.json's dict, or ``None``); never its
    path."""
    if isinstance(config, dict):
        kind, architectures = config.get("model_type"), config.get("architectures")
    else:
        kind, architectures = getattr(config, "model_type", None), getattr(config, "architectures", None)
    if not kind:
        kind = architectures[0] if isinstance(architectures, list) and architectures else "model"
    return str(kind)[:32]


def read_config_json(directory: str | os.PathLike | None) -> dict | None:
    """A model directory's config.json, or ``None`` when there is none
    that reads as a JSON object."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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


class FailedKeys:
    """Keys whose load failed (a value of the wrong size, corrupt, missing,
    the server gone), remembered until this process stores the key again:
    a lookup stops before them, so a failed block costs one recompute and
    is never offered again in a loop, and the store that follows the
    recompute replaces the value instead of keeping it (``skip_existing``
    off for these keys). At most ``limit`` keys; the oldest are forgotten
    first (one more failed load each, then remembered again)."""

    def __init__(self, limit: int = 1 << 16):
        self._keys: OrderedDict[Any, None] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self.replaced = 0

    def add(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
                self._keys[key] = None
            while len(self._keys) > self._limit:
                self._keys.popitem(last=False)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._keys

    def known(self, keys: list) -> list[bool]:
        """Which of ``keys`` failed (one look under the lock)."""
        with self._lock:
            if not self._keys:
                return [False] * len(keys)
            return [key in self._keys for key in keys]

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    def cut(self, keys: list) -> list:
        """``keys`` up to the first failed one."""
        with self._lock:
            if self._keys:
                for n, key in enumerate(keys):
                    if key in self._keys:
                        return keys[:n]
        return keys

    def take(self, keys: list) -> list[bool]:
        """Which of ``keys`` failed before (they are being stored now, so
        they are forgotten and must replace what is stored)."""
        with self._lock:
            if not self._keys:
                return [False] * len(keys)
            out = []
            for key in keys:
                failed = key in self._keys
                if failed:
                    del self._keys[key]
                    self.replaced += 1
                out.append(failed)
            return out


def put_in_two(put, replace: list[bool]) -> list[int]:
    """A batch put with ``skip_existing`` except for the keys marked in
    ``replace`` (values that failed to load: the new value replaces them):
    ``put(indices, skip_existing)`` stores the batch's values at
    ``indices`` and returns their codes. One call when nothing is marked,
    two otherwise; the codes come back in the batch's order."""
    from .. import errors

    codes = [errors.IO] * len(replace)
    for overwrite in (False, True):
        picked = [n for n, r in enumerate(replace) if r == overwrite]
        if picked:
            for n, code in zip(picked, put(picked, not overwrite)):
                codes[n] = code
    return codes


def put_replacing(client: Client, keys: list, ptrs: list, sizes: list, replace: list[bool]) -> list[int]:
    """``batch_put_from_multi_buffers`` through ``put_in_two``."""
    return put_in_two(
        lambda picked, skip: client.batch_put_from_multi_buffers(
            [keys[n] for n in picked], [ptrs[n] for n in picked], [sizes[n] for n in picked], skip_existing=skip
        ),
        replace,
    )
