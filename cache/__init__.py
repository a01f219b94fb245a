"""radixlm.cache: radix prefix tree over token ids → KV slots, KV pools and allocator.

The tree (`RadixCache`) is only an index; `PageAllocator` owns which slots are free;
`PrefixCache` joins the two for the scheduler's lifecycle (match, lock, alloc, insert,
unlock, evict/free); `KVPool`/`HostKVPool` hold the K/V tensors the slots address.
"""

from typing import TYPE_CHECKING, Any

from radixlm.cache.allocator import PageAllocator
from radixlm.cache.errors import (
    CacheError,
    DoubleFree,
    InvalidSlots,
    LockError,
    OutOfSlots,
    StaleHandle,
)
from radixlm.cache.node import TreeNode
from radixlm.cache.policy import (
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    make_policy,
)
from radixlm.cache.prefix_cache import PrefixCache
from radixlm.cache.radix import RadixCache
from radixlm.cache.results import CacheSizes, EvictedSegment, InsertResult, MatchResult

if TYPE_CHECKING:
    from radixlm.cache.kv_pool import HostKVPool, KVPool


def __getattr__(name: str) -> Any:
    # The KV pools need torch, whose import takes seconds; the tree and allocator do
    # not, so the pools load on first use.
    if name in ("KVPool", "HostKVPool"):
        from radixlm.cache import kv_pool

        return getattr(kv_pool, name)
    raise AttributeError(f"module 'radixlm.cache' has no attribute {name!r}")


__all__ = [
    "CacheError",
    "CacheSizes",
    "DoubleFree",
    "EvictedSegment",
    "EvictionPolicy",
    "HostKVPool",
    "InsertResult",
    "InvalidSlots",
    "KVPool",
    "LFUPolicy",
    "LRUPolicy",
    "LockError",
    "MatchResult",
    "OutOfSlots",
    "PageAllocator",
    "PrefixCache",
    "PriorityPolicy",
    "RadixCache",
    "StaleHandle",
    "TreeNode",
    "make_policy",
]
