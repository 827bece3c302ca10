"""kvtier: a tiered KV-cache store for LLM inference.

``Store(path, memory="1GiB", disk="16GiB")`` opens an embedded store in this
process; ``Client("unix:///path/kvtier.sock")`` or ``Client("tcp://host:port")``
talks to ``kvtier serve``. Both offer the same methods, including Mooncake's
``register_buffer``, ``batch_put_from``, ``batch_get_into`` and
``batch_is_exist``, and are context managers. Keys are ``str`` or ``bytes``.
"""

from . import errors
from ._native import Client, KvtierError, PendingCall, SharedBuffer, Store, block_keys_blake3

__all__ = ["Store", "Client", "SharedBuffer", "PendingCall", "KvtierError", "block_keys", "errors"]

from . import _schemes

_SCHEMES = ("blake3", "vllm-sha256-cbor", "sglang-sha256")


def block_keys(tokens, block_size=256, salt=b"", scheme="blake3", *, hash_seed=None):
    """Chained prefix keys, one per full block of ``tokens``; a trailing
    partial block gets no key.

    - ``"blake3"`` (default, 32-byte keys): key i is BLAKE3 over (key i-1, the
      salt's length as u32 LE and its bytes, block i's tokens as u32 LE); the
      first block chains from 32 zero bytes. Cryptographic, so no user can
      craft a prompt whose keys equal another user's.

    Keys say nothing of the model, dtype or layout: give every store or
    client a ``namespace`` naming those (for example
    ``"llama3-8b/bf16/tp0of2/page64"``), so blocks of incompatible engines
    never meet.
    - ``"vllm-sha256-cbor"`` (32-byte keys): vLLM's ``sha256_cbor`` block
      hashes; ``salt`` is vLLM's ``cache_salt``; ``hash_seed`` (default: the
      ``PYTHONHASHSEED`` environment variable) is the engine's
      ``PYTHONHASHSEED``, which vLLM needs set for reproducible hashes.
    - ``"sglang-sha256"`` (64-character hex strings): SGLang HiCache page
      hashes (``block_size`` is the page size; no salt).
    """
    if scheme not in _SCHEMES:
        raise ValueError(f"unknown key scheme {scheme!r}: supported: {', '.join(_SCHEMES)}")
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    tokens = [int(t) for t in tokens]
    if scheme == "vllm-sha256-cbor":
        return _schemes.vllm_sha256_cbor(tokens, block_size, salt, hash_seed)
    if scheme == "sglang-sha256":
        return _schemes.sglang_sha256(tokens, block_size, salt)
    if isinstance(salt, str):
        salt = salt.encode()
    return block_keys_blake3(tokens, block_size, bytes(salt))
