"""Result codes returned by kvtier's batch calls.

0 is success; errors are negative (Mooncake's convention). Batch gets return
the number of bytes read for a hit and a negative code otherwise; a miss is
``NOT_FOUND``. Whole-call failures (a closed store, a lost connection,
mismatched list lengths) raise instead: ``KvtierError`` or ``ValueError``.
"""

from ._native import (  # noqa: F401  (re-exported)
    BUFFER_TOO_SMALL,
    CLOSED,
    CORRUPTION,
    INVALID_ARGUMENT,
    IO,
    LIMIT,
    LOCKED,
    NO_SPACE,
    NOT_FOUND,
    OK,
    PROTOCOL,
    TIMEOUT,
    UNAUTHORIZED,
    UNSUPPORTED,
    KvtierError,
)

NAMES = {
    OK: "OK",
    INVALID_ARGUMENT: "INVALID_ARGUMENT: bad key or value, unregistered pointer, range out of bounds",
    BUFFER_TOO_SMALL: "BUFFER_TOO_SMALL: the value is larger than the destination",
    NO_SPACE: "NO_SPACE: no room in memory or on disk",
    CLOSED: "CLOSED: the store or connection is closed",
    IO: "IO: an I/O error",
    NOT_FOUND: "NOT_FOUND: a miss",
    UNAUTHORIZED: "UNAUTHORIZED: missing or wrong auth token",
    UNSUPPORTED: "UNSUPPORTED: not available on this transport",
    PROTOCOL: "PROTOCOL: malformed frame",
    LIMIT: "LIMIT: over a batch, frame or buffer limit",
    TIMEOUT: "TIMEOUT: timed out",
    CORRUPTION: "CORRUPTION: on-disk data failed validation",
    LOCKED: "LOCKED: the data directory is in use",
}


def describe(code: int) -> str:
    """A human-readable name for a result code."""
    if code >= 0:
        return f"OK ({code} bytes)" if code else "OK"
    return NAMES.get(code, f"unknown error {code}")
