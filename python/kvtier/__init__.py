"""kvtier: a tiered KV-cache store for LLM inference.

``Store(path, memory="4GiB", disk="64GiB")`` opens an embedded store in this
process; ``Client("unix:///path/kvtier.sock")`` or ``Client("tcp://host:port")``
talks to ``kvtier serve``. Both offer the same methods, including Mooncake's
``register_buffer``, ``batch_put_from``, ``batch_get_into`` and
``batch_is_exist``, and are context managers. Keys are ``str`` or ``bytes``.
"""

from . import errors
from ._native import Client, KvtierError, SharedBuffer, Store, block_keys_xxh3

__all__ = ["Store", "Client", "SharedBuffer", "KvtierError", "block_keys", "errors"]

_SCHEMES = ("xxh3",)


def block_keys(tokens, block_size=256, salt=b"", scheme="xxh3"):
    """Chained prefix keys, one per full block of ``tokens``.

    ``scheme="xxh3"``: key i is xxh3-128 over (key i-1, the salt's length and
    bytes, block i's tokens as little-endian u32); the first block chains
    from 16 zero bytes. A trailing partial block gets no key.
    """
    if scheme not in _SCHEMES:
        raise ValueError(f"unknown key scheme {scheme!r}: supported: {', '.join(_SCHEMES)}")
    if isinstance(salt, str):
        salt = salt.encode()
    return block_keys_xxh3([int(t) for t in tokens], block_size, bytes(salt))
