"""streamserve.sessions: the KV memory of persistent sessions.

A global paged pool (`KVPool`, `PageAllocator`) holds every session's keys and values; each session's
`PagedSessionKV` maps its tokens to pages under a `WindowPolicy` ([sinks | window], absolute or rolling
positions), with one page table per layer group (`LayerGroup`: the layers sharing a model-native window; a
local group keeps only its window plus the rewind reach). Depends only on torch and `streamserve.errors`,
never on the engine above it.
"""

from streamserve.sessions.groups import DEFAULT_REWIND_REACH, LayerGroup, layer_groups, split_pages
from streamserve.sessions.paged_kv import HostPages, PagedSessionKV
from streamserve.sessions.policy import WindowPolicy
from streamserve.sessions.pool import DEFAULT_PAGE_SIZE, KVPool, PageAllocator

__all__ = ["DEFAULT_PAGE_SIZE", "DEFAULT_REWIND_REACH", "HostPages", "KVPool", "LayerGroup", "PageAllocator",
           "PagedSessionKV", "WindowPolicy", "layer_groups", "split_pages"]
