OK: int
INVALID_ARGUMENT: int
BUFFER_TOO_SMALL: int
NO_SPACE: int
CLOSED: int
IO: int
NOT_FOUND: int
UNAUTHORIZED: int
UNSUPPORTED: int
PROTOCOL: int
LIMIT: int
TIMEOUT: int
CORRUPTION: int
LOCKED: int
NAMES: dict[int, str]

class KvtierError(Exception): ...

def describe(code: int) -> str: ...
