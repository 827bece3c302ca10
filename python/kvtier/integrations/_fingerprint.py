"""What a model is, read from its bytes: the fingerprint every integration
puts in its namespace, so that KV computed by other weights or other
numerics never meets this engine's requests.

A block key names tokens; the namespace must name the computation. A model
path names neither (weights are replaced in place by rolling updates, the
same weights live at other paths on other hosts), so the fingerprint is
made of:

- the **weights**: for every weight file vLLM or SGLang would load (the top
  level of the model directory), its name, its size, its structure
  (a safetensors file's whole header: tensor names, dtypes, shapes and
  offsets; the first MiB of a GGUF or torch file, where their tensor tables
  lie) and ``SAMPLES`` slices of ``SAMPLE_BYTES`` spread evenly over the
  file. The cost is fixed per file (about 1 MiB read), not per byte of the
  checkpoint; a change that touches no sampled byte and no header is not
  seen (a real weight update changes nearly every byte);
- the **resolved configuration** the engine runs with (after
  ``hf_overrides`` and every other override), as a digest of its fields
  minus the ones that name places (``_name_or_path``).

Never paths, mtimes or host names: two hosts with the same weights share
blocks, a copied checkpoint keeps hitting. A per-user cache keyed by file
identity (device, inode, size, mtime and ctime, host) skips rereading
unchanged files; ctime cannot be set back, so a file rewritten in place is
always read again. An operator may pin the weights part instead
(``model_fingerprint``: a registry digest, say).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import struct
import tempfile
import threading
from typing import Any

logger = logging.getLogger("kvtier")

# Files a loader reads weights from.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Per file: this many slices of this many bytes, evenly spread.
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
# What a format keeps its tensor table in, read whole.
SAFETENSORS_HEADER_LIMIT = 100 * 1024 * 1024  # the format's own limit
LEADING_BYTES = 1024 * 1024
# Fingerprint cache: where, and how many files it remembers.
CACHE_ENV = "KVTIER_FINGERPRINT_CACHE"
CACHE_ENTRIES = 4096
# Configuration fields that name places or tools, not the computation.
PLACE_FIELDS = frozenset({"_name_or_path", "name_or_path", "_commit_hash", "transformers_version"})

VERSION = b"kvtier model fingerprint v1"


class FingerprintError(ValueError):
    """The weights cannot be fingerprinted; the message says how to pin one."""


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """The digest (64 hex characters) of the weight files at the top level
    of ``model_dir``; raises ``FingerprintError`` when it holds none."""
    root = pathlib.Path(model_dir)
    try:
        files = sorted(p for p in root.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    except OSError as e:
        raise FingerprintError(f"cannot list the model directory {root}: {e}") from e
    if not files:
        raise FingerprintError(
            f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) at the top of {root}: set model_fingerprint "
            "in the integration's config to name the weights (a registry digest, say)"
        )
    total = hashlib.sha256(VERSION)
    cache = _Cache.load()
    for path in files:
        name = path.name.encode()
        total.update(struct.pack("<Q", len(name)) + name)
        total.update(_file_digest(path, cache))
    cache.save()
    return total.hexdigest()


def config_digest(fields: dict[str, Any]) -> str:
    """A digest of a resolved configuration, without the fields that name
    places (at any depth); values that JSON cannot hold are named by
    ``str``."""
    text = json.dumps(_without_places(fields), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _without_places(value: Any) -> Any:
    """``value`` with every field that names a place left out, at any depth
    (a configuration nests others: ``text_config``, a vision tower's)."""
    if isinstance(value, dict):
        return {k: _without_places(v) for k, v in value.items() if k not in PLACE_FIELDS}
    if isinstance(value, (list, tuple)):
        return [_without_places(v) for v in value]
    return value


def locate_weights(model: str, revision: str | None = None) -> pathlib.Path:
    """The local directory holding ``model``'s weights: the path itself, or
    the Hugging Face cache's snapshot of a hub name (never downloaded from
    here)."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True))
    except Exception as e:  # no hub library, no snapshot, or a name it refuses
        raise FingerprintError(
            f"the weights of {model!r} are not in a local directory or the Hugging Face cache ({e}): "
            "set model_fingerprint in the integration's config to name them"
        ) from e


# Fingerprints already logged by this process.
_logged: set[str] = set()
_logged_lock = threading.Lock()


def model_fingerprint(
    model: str, revision: str | None, config: dict[str, Any], pinned: str | None = None, engine: str = ""
) -> str:
    """The fingerprint of a model as an engine runs it: its weights (or the
    operator's ``pinned`` name for them) and its resolved ``config``; 64 hex
    characters, logged once per process. The weights are looked at on every
    call (their per-file digests come from the cache while the files are
    unchanged), so a process never keeps a fingerprint of replaced weights."""
    weights = str(pinned).strip() if pinned is not None else None
    if pinned is not None and not weights:
        raise FingerprintError("model_fingerprint is empty: name the weights or leave it out")
    configuration = config_digest(config)
    source = f"pinned {weights!r}"
    if weights is None:
        directory = locate_weights(model, revision)
        weights = weights_fingerprint(directory)
        source = f"weights in {directory}"
    digest = hashlib.sha256(VERSION + b"\0" + weights.encode() + b"\0" + configuration.encode()).hexdigest()
    with _logged_lock:
        first = digest not in _logged
        _logged.add(digest)
    if first:
        logger.info("kvtier: %s model fingerprint %s (%s, configuration %s)", engine or "engine", digest[:16],
                    source, configuration[:16])
    return digest


def _file_digest(path: pathlib.Path, cache: _Cache) -> bytes:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        identity = cache.identity(st)
        known = cache.get(identity)
        if known is not None:
            return known
        digest = hashlib.sha256(struct.pack("<Q", st.st_size))
        structure_end = _structure(f, path, st.st_size, digest)
        span = st.st_size - structure_end
        if span > 0:
            for i in range(SAMPLES):
                at = structure_end + (max(0, span - SAMPLE_BYTES) * i) // (SAMPLES - 1)
                chunk = os.pread(f.fileno(), min(SAMPLE_BYTES, span), at)
                digest.update(struct.pack("<QQ", at, len(chunk)) + chunk)
    value = digest.digest()
    cache.put(identity, value)
    return value


def _structure(f, path: pathlib.Path, size: int, digest) -> int:
    """Feeds the file's tensor table to ``digest``; returns where the
    sampled data begins."""
    fd = f.fileno()
    if path.name.endswith(".safetensors"):
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise FingerprintError(f"{path} is not a safetensors file: {size} bytes")
        (length,) = struct.unpack("<Q", head)
        if length > SAFETENSORS_HEADER_LIMIT or length > size - 8:
            raise FingerprintError(f"{path} is not a safetensors file: its header claims {length} bytes")
        header = os.pread(fd, length, 8)
        try:
            json.loads(header)
        except ValueError as e:
            raise FingerprintError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
        digest.update(b"safetensors\0" + header)
        return 8 + length
    # GGUF keeps its tensor table, a torch zip its pickle, at the start.
    leading = os.pread(fd, min(LEADING_BYTES, size), 0)
    digest.update(b"leading\0" + leading)
    return len(leading)


class _Cache:
    """Per-file digests from earlier runs, keyed by file identity; a cache
    that cannot be read or written is ignored (the files are read)."""

    def __init__(self, path: pathlib.Path | None, entries: dict[str, str]):
        self.path, self.entries, self.dirty = path, entries, False

    @classmethod
    def load(cls) -> _Cache:
        """The cache file's entries, read once per process and path (a
        long-lived process asks on every batch: a stat per file and this
        dict, no reread)."""
        setting = os.environ.get(CACHE_ENV)
        if setting == "off":
            return cls(None, {})
        path = pathlib.Path(setting) if setting else _default_cache_path()
        with _loaded_lock:
            entries = _loaded.get(path)
            if entries is None:
                try:
                    with open(path, encoding="utf-8") as f:
                        found = json.load(f)
                except (OSError, ValueError):
                    found = {}
                found = found if isinstance(found, dict) else {}
                entries = {k: v for k, v in found.items() if isinstance(k, str) and isinstance(v, str)}
                _loaded[path] = entries
        return cls(path, entries)

    @staticmethod
    def identity(st: os.stat_result) -> str:
        return f"{os.uname().nodename}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def get(self, identity: str) -> bytes | None:
        value = self.entries.get(identity)
        try:
            return bytes.fromhex(value) if value is not None and len(value) == 64 else None
        except ValueError:
            return None

    def put(self, identity: str, digest: bytes) -> None:
        with _loaded_lock:
            self.entries.pop(identity, None)
            self.entries[identity] = digest.hex()
            while len(self.entries) > CACHE_ENTRIES:
                self.entries.pop(next(iter(self.entries)))
        self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        with _loaded_lock:
            snapshot = dict(self.entries)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".fingerprints-")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(snapshot, f)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.debug("kvtier: fingerprint cache %s not written: %s", self.path, e)


# Cache files read by this process: path -> entries (shared by every _Cache
# of that path, so a put is seen by the next lookup without a reread).
_loaded: dict[pathlib.Path, dict[str, str]] = {}
_loaded_lock = threading.Lock()


def _default_cache_path() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "kvtier" / "fingerprints.json"
