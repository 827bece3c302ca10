"""Engine integrations, loaded by the engines themselves from configuration.

- ``kvtier.integrations.vllm``: ``KvtierConnector``, a vLLM KV connector
  (``--kv-transfer-config '{"kv_connector": "KvtierConnector",
  "kv_connector_module_path": "kvtier.integrations.vllm", ...}'``).
- ``kvtier.integrations.sglang``: ``KvtierHiCacheStorage``, an SGLang
  HiCache storage backend (``--hicache-storage-backend dynamic``).

Both talk to a ``kvtier serve`` on the same host (see ``docs/integrations.md``).
Importing this package imports neither torch nor an engine: each submodule
imports its engine when the engine loads it.
"""

from ._common import DEFAULT_URL, connect, namespace_for, resolve_url

__all__ = ["DEFAULT_URL", "connect", "namespace_for", "resolve_url"]
