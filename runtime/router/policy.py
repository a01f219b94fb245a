"""Where new work goes: the replica with the longest estimated cached prefix, unless the
replicas' loads are too far apart (docs/deployment.md states the rule for users).

A replica's load is the tokens of the requests the router has in flight there: each
one's estimated prompt tokens not matched in that replica's part of the tree, plus its
``max_tokens`` (what it may still run and queue).

1. **Imbalance**: when the busiest and the idlest live replicas differ by more than
   `Balance.abs_tokens` *and* the busiest carries more than `Balance.rel` times the
   idlest's load, the least loaded replica gets the request (ties: the longer match).
2. **Cache**: otherwise the replica with the longest match gets it (ties: the lower
   load), if that match covers at least `Balance.cache_threshold` of the key.
3. **Room**: otherwise the least loaded replica (ties: the smaller tree: more room).

``round_robin`` ignores caches and loads (the benchmark's baseline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Balance", "choose"]


@dataclass(frozen=True)
class Balance:
    policy: str = "cache_aware"  # or "round_robin"
    cache_threshold: float = 0.5  # fraction of the key a match must cover
    abs_tokens: int = 4096  # load gap (tokens) that may count as imbalance...
    rel: float = 1.5  # ...when the busiest also carries this many times the idlest's


def choose(balance: Balance, live: Sequence[int], matched: Mapping[int, int], key_len: int,
           loads: Mapping[int, int], sizes: Mapping[int, int], turn: int) -> int:
    """The replica (of the non-empty `live`) for a request whose key has `key_len`
    characters, given each replica's match (`matched`, characters), load (tokens) and
    tree size; `turn` counts decisions (for round-robin)."""
    if balance.policy == "round_robin":
        return live[turn % len(live)]
    if len(live) == 1:
        return live[0]
    lo = min(loads.get(r, 0) for r in live)
    hi = max(loads.get(r, 0) for r in live)
    if hi - lo > balance.abs_tokens and hi > balance.rel * lo:
        return min(live, key=lambda r: (loads.get(r, 0), -matched.get(r, 0)))
    best = max(live, key=lambda r: (matched.get(r, 0), -loads.get(r, 0)))
    if key_len and matched.get(best, 0) >= balance.cache_threshold * key_len:
        return best
    return min(live, key=lambda r: (loads.get(r, 0), sizes.get(r, 0)))
