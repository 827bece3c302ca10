"""Block-key schemes against references built from each engine's documented
algorithm.

Sources: vLLM ``vllm/utils/hashing.py`` (``sha256_cbor`` =
``hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()``) and
``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens`` hashes
``(parent_block_hash, tuple(token_ids), extra_keys)``, with ``NONE_HASH =
sha256_cbor(PYTHONHASHSEED)`` for the first block and ``cache_salt`` in the
first block's extra keys); SGLang ``hicache_storage.py`` (``get_hash_str``:
SHA-256 over the prior hex digest's bytes then each token id as 4
little-endian bytes). The vLLM reference below uses cbor2, the library vLLM
itself calls; the fixed vectors were produced by these references.
"""

import hashlib

import cbor2
import pytest

import kvtier


def vllm_reference(tokens, block_size, seed, cache_salt=None):
    def sha256_cbor(obj):
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    none_hash = sha256_cbor(seed)
    parent = None
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        extra = (cache_salt,) if (i == 0 and cache_salt) else None
        parent = sha256_cbor((parent if parent else none_hash, block, extra))
        out.append(parent)
    return out


def sglang_reference(tokens, page_size):
    out, prior = [], None
    for i in range(len(tokens) // page_size):
        h = hashlib.sha256()
        if prior:
            h.update(bytes.fromhex(prior))
        for t in tokens[i * page_size:(i + 1) * page_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior = h.hexdigest()
        out.append(prior)
    return out


def test_vllm_sha256_cbor_matches_the_reference():
    tokens = list(range(1000, 1000 + 70))
    for seed, salt in [("0", None), ("42", None), ("0", "tenant-a")]:
        ours = kvtier.block_keys(tokens, block_size=16, salt=salt or b"", scheme="vllm-sha256-cbor", hash_seed=seed)
        assert ours == vllm_reference(tokens, 16, seed, salt)
        assert len(ours) == 4
    assert kvtier.block_keys(list(range(8)), 4, scheme="vllm-sha256-cbor", hash_seed="0")[1].hex() == (
        "ed6fa5d37a067707ede9aff44aa2819ab639263ca4ca66e8d36d02ffac952d33"
    )


def test_vllm_needs_a_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        kvtier.block_keys([1, 2, 3, 4], 4, scheme="vllm-sha256-cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert kvtier.block_keys([1, 2, 3, 4], 4, scheme="vllm-sha256-cbor") == vllm_reference([1, 2, 3, 4], 4, "7")


def test_sglang_sha256_matches_the_reference():
    tokens = [5, 1, 2**32 - 1, 7] * 20
    assert kvtier.block_keys(tokens, block_size=8, scheme="sglang-sha256") == sglang_reference(tokens, 8)
    assert kvtier.block_keys(list(range(8)), 4, scheme="sglang-sha256") == [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ]
    with pytest.raises(ValueError, match="no salt"):
        kvtier.block_keys([1, 2], 2, salt=b"x", scheme="sglang-sha256")


def test_scheme_keys_work_as_store_keys(tmp_path):
    with kvtier.Store(str(tmp_path / "s"), memory="16MiB", disk="64MiB") as s:
        for scheme, kwargs in [("blake3", {}), ("vllm-sha256-cbor", {"hash_seed": "0"}), ("sglang-sha256", {})]:
            keys = kvtier.block_keys(list(range(64)), 16, scheme=scheme, **kwargs)
            assert s.batch_put_from(keys[:2], [b"a" * 100, b"b" * 100]) == [0, 0]
            assert s.prefix_len(keys) == 2
