"""Type stubs for kvtier (the runtime docstrings come from the native module)."""

from collections.abc import Buffer, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, Literal, Self, overload

from . import errors as errors

Key = str | bytes
Size = int | str  # bytes, or "64MiB", "4GiB", ...

class KvtierError(Exception):
    """A whole call failed: closed store, lost connection, bad configuration."""

class SharedBuffer:
    """Shared memory registered with the server (from ``Client.alloc_buffer``);
    supports the buffer protocol."""

    @property
    def ptr(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class PendingCall:
    """A batch call running in the background (``*_async`` methods): each
    call on a thread of its own, never queued behind another call; threads
    are kept idle between calls (at most 4, named ``kvtier-async``)."""

    def done(self) -> bool:
        """Whether the call has finished."""
    def wait(self) -> list[int]:
        """Waits (GIL released) and returns what the synchronous form
        returns, or raises what it raises; later calls return the same.
        Returns after the call's ``notify_fd`` write, so the descriptor may
        be closed then."""

class _Engine:
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool: ...
    def register_buffer(self, target: int | Any, size: int | None = None) -> int:
        """Registers ``[ptr, ptr + size)`` (checked against this process's
        mappings), or a writable buffer-protocol object (kept alive while
        registered), for raw-pointer calls. 0, or ValueError."""
    def unregister_buffer(self, ptr: int) -> int:
        """Forgets the range at ``ptr`` once no call uses it; 0 or a negative code."""
    @overload
    def batch_put_from(
        self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int], *,
        memory_only: bool = False, skip_existing: bool = False, durable: bool = False,
    ) -> list[int]:
        """Mooncake form: raw pointers into registered memory. A code per key (0 = stored)."""
    @overload
    def batch_put_from(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], sizes: None = None, *,
        memory_only: bool = False, skip_existing: bool = False, durable: bool = False,
    ) -> list[int]:
        """Buffer-protocol values (bytes, bytearray, memoryview, numpy arrays)."""
    @overload
    def batch_get_into(self, keys: Sequence[Key], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Per key: bytes read, or a negative code (NOT_FOUND for a miss)."""
    @overload
    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Buffer], sizes: None = None) -> list[int]:
        """Writable, C-contiguous, non-overlapping buffers."""
    def batch_put_from_async(
        self, keys: Sequence[Key], items: Sequence[int] | Sequence[Buffer], sizes: Sequence[int] | None = None, *,
        memory_only: bool = False, skip_existing: bool = False, durable: bool = False, notify_fd: int | None = None,
    ) -> PendingCall:
        """``batch_put_from`` in the background; leave the values unchanged until ``wait()``.
        ``notify_fd``: an eventfd, open until the call is done, that gets 1
        written to it then (without the GIL)."""
    def batch_get_into_async(
        self, keys: Sequence[Key], items: Sequence[int] | Sequence[Buffer], sizes: Sequence[int] | None = None, *,
        notify_fd: int | None = None,
    ) -> PendingCall:
        """``batch_get_into`` in the background; read the buffers after ``wait()``.
        ``notify_fd``: as ``batch_put_from_async``'s."""
    def batch_put_from_multi_buffers(
        self, keys: Sequence[Key], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]], *,
        memory_only: bool = False, skip_existing: bool = False, durable: bool = False,
    ) -> list[int]:
        """One value per key gathered from registered ranges laid end to end
        (a block's pages across layers). A code per key (0 = stored)."""
    def batch_get_into_multi_buffers(
        self, keys: Sequence[Key], ptrs_per_key: Sequence[Sequence[int]], sizes_per_key: Sequence[Sequence[int]],
    ) -> list[int]:
        """Each value scattered across its registered ranges, in order. Per
        key: bytes read, or a negative code (NOT_FOUND for a miss)."""
    def get_into(self, key: Key, buffer: Buffer) -> int: ...
    def batch_is_exist(self, keys: Sequence[Key]) -> list[int]: ...
    def is_exist(self, key: Key) -> int: ...
    def prefix_len(self, keys: Sequence[Key]) -> int: ...
    def put(self, key: Key, value: Buffer) -> int: ...
    def get(self, key: Key) -> bytes:
        """The value, or ``b""`` on a miss."""
    def remove(self, key: Key) -> int:
        """0 if removed, ``errors.NOT_FOUND`` if absent (durable on return)."""
    def flush(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def namespaces(self) -> dict[str, Any]:
        """``{"node", "namespaces": [{"name", "blocks", "bytes",
        "memory_only_blocks", "manifest", "last_used_unix_s"}]}``: a census
        of what the store (or the server, within this credential) holds."""
    def retire_namespace(self) -> dict[str, int]:
        """Removes every block of this object's namespace, durably:
        ``{"blocks", "bytes", "tombstones"}``."""
    def describe_namespace(self, manifest: dict[str, Any] | str | bytes) -> None:
        """Stores this namespace's manifest (a JSON object, at most 16 KiB)."""

class Store(_Engine):
    """The embedded store, in this process."""

    def __init__(
        self,
        path: str | PathLike[str],
        memory: Size = "1GiB",
        disk: Size = "16GiB",
        *,
        namespace: str = "",
        region_size: Size | None = None,
        io_engine: Literal["uring", "psync"] | None = None,
        eviction: Literal["s3fifo", "lru"] | None = None,
        max_value_size: Size | None = None,
        shared_dir: str | PathLike[str] | None = None,
    ) -> None: ...

class Client(_Engine):
    """Connections to ``kvtier serve`` over ``unix:///path`` or ``tcp://host:port``.

    Calls from several threads run in parallel, each on a connection of its
    own: connections open on demand, up to ``connections`` (default 4), and
    all register the same shared buffer. ``route=True``: in cluster mode, the
    socket forms of the batch calls go straight to the members that own each
    key (one hop) instead of through this server (see docs/cluster.md).
    ``cross_memory=True`` (Unix sockets): the server reads and writes the
    caller's own buffers directly where the kernel lets it (one copy instead
    of two through the socket; see docs/server.md, "Cross-memory transfers").
    ``map_pool=True`` (Unix sockets, a client of the server's own user
    without a tenant's token): values in the server's memory are copied in
    this process out of a read-only mapping of the server's pool, leased
    for the copy (docs/protocol.md, "Pool mapping").
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "",
        auth_token: str | None = None,
        tls_ca: str | PathLike[str] | None = None,
        timeout: float = 60.0,
        shm_size: Size | None = None,
        connections: int = 4,
        route: bool = False,
        cross_memory: bool = True,
        map_pool: bool = True,
    ) -> None: ...
    def alloc_buffer(self, size: int) -> SharedBuffer:
        """Shared memory the server reads and writes directly (Unix socket only)."""

@overload
def block_keys(
    tokens: Sequence[int], block_size: int = 256, salt: bytes | str = b"", scheme: Literal["blake3"] = "blake3",
    *, hash_seed: str | None = None,
) -> list[bytes]: ...
@overload
def block_keys(
    tokens: Sequence[int], block_size: int, salt: bytes | str, scheme: Literal["vllm-sha256-cbor"],
    *, hash_seed: str | None = None,
) -> list[bytes]: ...
@overload
def block_keys(
    tokens: Sequence[int], block_size: int, salt: bytes | str, scheme: Literal["sglang-sha256"],
    *, hash_seed: str | None = None,
) -> list[str]: ...
