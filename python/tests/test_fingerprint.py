"""The model fingerprint the integrations put in their namespaces: made of
the weights' bytes and the resolved configuration, never of paths; a fixed
read budget per file; a cache that never outlives a rewrite."""

import json
import os
import shutil
import struct

import pytest

from kvtier.integrations import _fingerprint as fp
from kvtier.integrations._common import MAX_NAMESPACE_BYTES, namespace_for, namespace_prefix


def safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file: 8-byte header length, JSON header, data."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def model_dir(root, seed: int = 1, size: int = 3 << 20):
    root.mkdir(parents=True, exist_ok=True)
    raw = bytes((i * 131 + seed) % 251 for i in range(size))
    safetensors(root / "model.safetensors", {"w": ("F32", [size // 4], raw)})
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": str(root)}))
    return root


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(fp.CACHE_ENV, str(tmp_path / "cache" / "fingerprints.json"))


def test_a_copy_elsewhere_has_the_same_fingerprint_and_any_sampled_byte_changes_it(tmp_path):
    original = model_dir(tmp_path / "hostA" / "llama")
    copy = tmp_path / "hostB" / "other-name"
    shutil.copytree(original, copy)
    assert fp.weights_fingerprint(original) == fp.weights_fingerprint(copy)

    path = copy / "model.safetensors"
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    data_start = 8 + length
    size = path.stat().st_size
    span = size - data_start
    # Every sample, its first and last byte: each flip is seen.
    for i in range(fp.SAMPLES):
        at = data_start + (max(0, span - fp.SAMPLE_BYTES) * i) // (fp.SAMPLES - 1)
        for offset in (at, at + fp.SAMPLE_BYTES - 1):
            content = bytearray(path.read_bytes())
            content[offset] ^= 0x01
            path.write_bytes(bytes(content))
            assert fp.weights_fingerprint(copy) != fp.weights_fingerprint(original), (i, offset)
            content[offset] ^= 0x01
            path.write_bytes(bytes(content))
    assert fp.weights_fingerprint(copy) == fp.weights_fingerprint(original)


def test_the_tensor_table_is_part_of_the_fingerprint(tmp_path):
    raw = bytes(range(256)) * 64
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    safetensors(a / "model.safetensors", {"w": ("F32", [4096], raw)})
    safetensors(b / "model.safetensors", {"w": ("BF16", [8192], raw)})  # same bytes, read otherwise
    assert fp.weights_fingerprint(a) != fp.weights_fingerprint(b)


def test_the_read_budget_is_fixed_per_file(tmp_path, monkeypatch):
    root = model_dir(tmp_path / "m", size=24 << 20)
    read = []
    real = os.pread

    def counting(fd, n, offset):
        chunk = real(fd, n, offset)
        read.append(len(chunk))
        return chunk

    monkeypatch.setattr(fp.os, "pread", counting)
    monkeypatch.setenv(fp.CACHE_ENV, "off")
    fp.weights_fingerprint(root)
    header = json.dumps({"w": {}}).encode()
    assert sum(read) <= fp.SAMPLES * fp.SAMPLE_BYTES + 8 + 4 * len(header) + 4096, sum(read)
    assert sum(read) < (24 << 20) // 10


def test_the_cache_skips_rereads_until_the_file_changes_in_place(tmp_path, monkeypatch):
    root = model_dir(tmp_path / "m")
    first = fp.weights_fingerprint(root)
    reads = []
    real = os.pread
    monkeypatch.setattr(fp.os, "pread", lambda fd, n, off: reads.append(n) or real(fd, n, off))
    assert fp.weights_fingerprint(root) == first
    assert reads == [], "an unchanged file was read again"

    # Rewritten in place: same size, the old mtime put back. ctime moves,
    # so the cache misses and the new bytes are read.
    path = root / "model.safetensors"
    stat = path.stat()
    content = bytearray(path.read_bytes())
    content[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(content))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns
    assert fp.weights_fingerprint(root) != first
    assert reads, "the rewritten file was not read"


def test_files_that_lie_or_are_missing_are_refused_with_the_way_out(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(fp.FingerprintError, match="model_fingerprint"):
        fp.weights_fingerprint(empty)
    liar = tmp_path / "liar"
    liar.mkdir()
    (liar / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(fp.FingerprintError, match="header claims"):
        fp.weights_fingerprint(liar)
    (liar / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope" + b"\0" * 64)
    with pytest.raises(fp.FingerprintError, match="not JSON"):
        fp.weights_fingerprint(liar)
    with pytest.raises(fp.FingerprintError, match="model_fingerprint"):
        fp.locate_weights(str(tmp_path / "no-such-model"))


def test_the_model_fingerprint_covers_the_resolved_configuration_never_its_place(tmp_path):
    root = model_dir(tmp_path / "m")
    config = {"hidden_size": 256, "rms_norm_eps": 1e-6, "_name_or_path": str(root)}
    base = fp.model_fingerprint(str(root), None, config)
    moved = fp.model_fingerprint(str(root), None, dict(config, _name_or_path="/elsewhere"))
    assert moved == base
    nested = {"hf_config": dict(config, text_config={"_name_or_path": str(root), "eps": 1})}
    assert fp.model_fingerprint(str(root), None, nested) == fp.model_fingerprint(
        str(root), None, {"hf_config": dict(config, _name_or_path="/x", text_config={"_name_or_path": "/y", "eps": 1})}
    )
    assert fp.model_fingerprint(str(root), None, dict(config, rms_norm_eps=0.5)) != base
    pinned = fp.model_fingerprint(str(tmp_path / "absent"), None, config, pinned="sha256:abc")
    assert pinned != base
    assert fp.model_fingerprint(str(tmp_path / "absent"), None, config, pinned="sha256:abd") != pinned
    with pytest.raises(fp.FingerprintError):
        fp.model_fingerprint(str(root), None, config, pinned="  ")


def test_a_namespace_keeps_the_prefix_whole_and_fits_the_server_limit():
    long_fields = {"label": "x" * 200, "dtype": "float32", "rank": "pp0of1-tp0of1", "fingerprint": "f" * 64}
    plain = namespace_for("vllm", long_fields)
    prefixed = namespace_for("vllm", long_fields, namespace_prefix("/team-a/prod/"))
    assert prefixed.startswith("team-a/prod/vllm/")
    assert len(plain.encode()) <= MAX_NAMESPACE_BYTES and len(prefixed.encode()) <= MAX_NAMESPACE_BYTES
    assert prefixed.rsplit("/", 1)[1] == plain.rsplit("/", 1)[1]  # the digest is the configuration's
    assert namespace_for("vllm", dict(long_fields, fingerprint="e" * 64)) != plain
    assert namespace_prefix(None) == ""
    for bad in ("a//b", "/", "t" * 120, 7):
        with pytest.raises(ValueError, match="namespace_prefix"):
            namespace_prefix(bad)
