"""Exceptions raised by radixlm.cache: one base class so callers can catch them all."""

from __future__ import annotations


class CacheError(RuntimeError):
    """Base class of every error the cache raises on misuse or exhaustion."""


class OutOfSlots(CacheError):
    """An allocation could not be satisfied even after evicting every unlocked leaf."""

    def __init__(
        self, requested: int, free: int, evictable: int, protected: int, capacity: int
    ) -> None:
        self.requested = requested
        self.free = free
        self.evictable = evictable
        self.protected = protected
        self.capacity = capacity
        super().__init__(
            f"out of KV slots: requested {requested} tokens, but only {free} are free "
            f"after eviction ({evictable} evictable left, {protected} locked by running "
            f"requests, capacity {capacity}); finish or unlock requests, or raise capacity"
        )


class DoubleFree(CacheError):
    """Slots handed to `free` that are already free (a caller bug: freed twice)."""


class InvalidSlots(CacheError):
    """Slots that are out of range or not whole, page-aligned pages."""


class StaleHandle(CacheError):
    """A node that was evicted (or belongs to a reset tree) was locked or unlocked."""


class LockError(CacheError):
    """`unlock` without a matching `lock`."""
