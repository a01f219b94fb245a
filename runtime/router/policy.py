"""Where new work goes: the replica with the longest estimated cached prefix, unless the
replicas' loads are too far apart (docs/deployment.md states the rule for users).

A replica's load is the tokens of the requests the router has in flight there: each
one's estimated prompt tokens not matched in that replica's part of the tree, plus its
``max_tokens`` (what it may still run and queue).

1. **Imbalance**: when the busiest and the idlest live replicas differ by more than a
   gap *and* the busiest carries more than `Balance.rel` times the idlest's load, the
   request goes where its load plus its own uncached tokens (what that replica would
   compute of it) is least: new work goes to the idle replica, a long cached
   conversation stays home unless the gap exceeds its recomputation. The gap is
   `Balance.abs_tokens` for a **continuation** (the key runs through the whole of a key
   sent before and nothing was sent beyond it: a conversation's next turn, history
   re-sent) and `Balance.new_abs_tokens` (smaller) for new work: a burst of new
   conversations on one shared prompt spreads after a few requests (each replica
   computes the prompt once) rather than piling onto the first replica that has it,
   which left the replicas' homes, and so their loads, uneven for the whole run and
   then moved conversations (recomputing them) to even them out.
2. **Cache**: otherwise the replica with the longest match gets it (ties: the lower
   load, then the lower index), if that match covers at least
   `Balance.cache_threshold` of the key.
3. **Room**: otherwise the least loaded replica (ties: the smaller tree: more room,
   then the lower index).

``round_robin`` ignores caches and loads (the benchmark's baseline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from radixlm.runtime.router.keys import CHARS_PER_TOKEN
from radixlm.runtime.router.prefix_tree import Match

__all__ = ["Balance", "choose"]


@dataclass(frozen=True)
class Balance:
    policy: str = "cache_aware"  # or "round_robin"
    cache_threshold: float = 0.5  # fraction of the key a match must cover
    # Load gap (tokens) that may count as imbalance... (wide for a continuation: moving
    # a conversation recomputes it, a cost for good; a queue's gap passes)
    abs_tokens: int = 4096
    new_abs_tokens: int = 256  # (...for a request that continues no key sent before)
    rel: float = 1.5  # ...when the busiest also carries this many times the idlest's


def choose(balance: Balance, live: Sequence[int], alive: AbstractSet[int], match: Match,
           key_len: int, loads: Sequence[int], sizes: Mapping[int, int], turn: int) -> int:
    """The replica (of the non-empty `live`, `alive` as a set) for a request whose key
    has `key_len` characters and runs through `match` in the tree, given each replica's
    load (`loads[i]`, tokens) and tree size; `turn` counts decisions (round-robin)."""
    if balance.policy == "round_robin":
        return live[turn % len(live)]
    if len(live) == 1:
        return live[0]
    view = loads if len(alive) == len(loads) else [loads[r] for r in live]
    lo, hi = min(view), max(view)  # builtins: one C pass each
    gap = balance.abs_tokens if match.continues() else balance.new_abs_tokens
    if hi - lo > gap and hi > balance.rel * lo:
        # the cheapest place: load plus what it would have to compute of this request
        # (a conversation leaves its cache only for a gap larger than its recomputation)
        lengths = match.lengths()
        return min(live, key=lambda r: (
            loads[r] + (key_len - lengths.get(r, 0)) // CHARS_PER_TOKEN, -lengths.get(r, 0)))
    best, best_len = match.longest(alive, loads)
    if best >= 0 and key_len and best_len >= balance.cache_threshold * key_len:
        return best
    if view.count(lo) == 1:  # (only now: the rules above need no idlest list)
        return live[view.index(lo)]
    idlest = [live[i] for i, load in enumerate(view) if load == lo]
    return min(idlest, key=lambda r: sizes.get(r, 0))
