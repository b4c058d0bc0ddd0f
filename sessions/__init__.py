"""streamserve.sessions: the KV memory of persistent sessions.

`ContiguousKVCache` keeps one session's keys and values in growing per-layer buffers. It depends only
on torch and `streamserve.errors`, never on the engine above it.
"""

from streamserve.sessions.kv_cache import ContiguousKVCache

__all__ = ["ContiguousKVCache"]
