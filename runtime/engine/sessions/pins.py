"""Pins: named shared prefixes (system and tool prompts) held in the cache for sessions and
programs to start from.

A pin is refused before its prefill (`check`: name taken, or beyond the retention cap),
made once its tokens are in the tree (`pin`: the node ending them is locked) and released
by name (`unpin`: its KV stays as evictable cache; sessions opened from it keep their own
locks). Apart from manager.py because a pin has no turns, owner or history: it is one
locked path, counted against the same retention cap as the sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from radixlm.cache import PrefixCache
from radixlm.runtime.engine.sessions.durability import Durability
from radixlm.runtime.engine.sessions.records import Held, PinnedPrefix, Records, frozen_ids
from radixlm.runtime.engine.sessions.retention import Retention
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)


class Pins:
    """The pins of one `SessionManager` (the manager's `pinned`), kept in its `Records`."""

    def __init__(self, records: Records, cache: PrefixCache, retention: Retention,
                 durability: Durability) -> None:
        self.records = records
        self.cache = cache
        self.retention = retention
        self.durability = durability

    def get(self, name: str, namespace: str | None) -> PinnedPrefix:
        """The pin `name` of `namespace` (a session opens from it); otherwise NOT_FOUND."""
        pin = self.records.pins.get(name)
        if pin is None or pin.namespace != namespace:
            where = f" in namespace {namespace!r}" if pin is not None else ""
            raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {name!r}{where}")
        return pin

    def check(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> None:
        """Refuse a pin before it is prefilled: name taken, or beyond the retention cap
        (after demoting idle soft sessions). An empty name is the frontend's rule."""
        if name in self.records.pins:
            raise RequestError(ErrorCode.DUPLICATE_ID, f"a prefix is already pinned as {name!r}")
        self.retention.admit(Held(namespace, self.retention.cacheable(frozen_ids(ids))))

    def pin(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> PinnedPrefix:
        """Hold the prefilled (and inserted) `ids` as the pin `name` (its node is found by
        matching them, as in `SessionManager.end_turn`)."""
        ids = frozen_ids(ids)
        self.check(name, ids, namespace)
        m = self.cache.match(ids, namespace)
        locked = m.node if m.length else None
        if locked is not None:
            self.records.lock_node(locked)
        pin = PinnedPrefix(name, namespace, ids, locked, m.length)
        self.records.pins[name] = pin
        log.info("pinned %r (%d tokens, %d cached)", name, len(ids), m.length)
        return pin

    def unpin(self, name: str) -> None:
        """Release a pin (its KV stays as evictable cache; sessions opened from it keep
        their own locks)."""
        pin = self.records.pins.pop(name, None)
        if pin is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {name!r}")
        if pin.node is not None:
            self.records.unlock_node(pin.node)
        self.durability.forget_pin(name)
        log.info("unpinned %r", name)
