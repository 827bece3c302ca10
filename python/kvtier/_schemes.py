"""Block-key schemes of other engines, so kvtier can share their keys.

- ``vllm-sha256-cbor``: vLLM's prefix-cache block hashes with
  ``--prefix-caching-hash-algo sha256_cbor``. Block i's hash is
  SHA-256 over the canonical CBOR encoding of the tuple
  ``(parent_hash, tuple(block_token_ids), extra_keys)``; the first block's
  parent is ``NONE_HASH = sha256_cbor(PYTHONHASHSEED)`` (vLLM picks a random
  start when ``PYTHONHASHSEED`` is unset, so keys are only reproducible with a
  seed); ``extra_keys`` is ``(cache_salt,)`` on the first block when a cache
  salt is given and ``None`` otherwise (no LoRA, no multimodal inputs).
- ``sglang-sha256``: SGLang HiCache page hashes: SHA-256 over the parent
  page's digest bytes (none for the first page) followed by each token id as
  4 little-endian bytes, as a hex string (SGLang's storage keys are these
  strings).

CBOR comes from ``cbor2`` (``canonical=True``), the library vLLM itself
calls, so the bytes hashed are the bytes vLLM hashes.
"""

import hashlib
import os


def sha256_cbor(obj) -> bytes:
    # Imported here: `import kvtier` stays light for users of other schemes.
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_sha256_cbor(tokens, block_size, salt, hash_seed):
    if hash_seed is None:
        hash_seed = os.environ.get("PYTHONHASHSEED")
    if hash_seed is None:
        raise ValueError(
            "vLLM starts its hash chain from a random value unless PYTHONHASHSEED is set; "
            "pass hash_seed= (the PYTHONHASHSEED the engine runs with) to reproduce its keys"
        )
    if isinstance(salt, (bytes, bytearray)):
        salt = bytes(salt).decode("utf-8")
    parent = sha256_cbor(str(hash_seed))
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(int(t) for t in tokens[start:start + block_size])
        extra = (salt,) if (start == 0 and salt) else None
        parent = sha256_cbor((parent, block, extra))
        keys.append(parent)
    return keys


def sglang_sha256(tokens, block_size, salt):
    if salt:
        raise ValueError("sglang-sha256 page hashes take no salt (SGLang backends add a per-model key suffix)")
    keys = []
    prior = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hasher = hashlib.sha256()
        if prior is not None:
            hasher.update(bytes.fromhex(prior))
        for t in tokens[start:start + block_size]:
            hasher.update(int(t).to_bytes(4, byteorder="little", signed=False))
        prior = hasher.hexdigest()
        keys.append(prior)
    return keys
