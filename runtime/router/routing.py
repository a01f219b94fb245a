"""The routing decision for new work, kept apart from sockets so that it can be measured
alone (benchmarks/bench_router.py, the routing-cost row): a key, a tree match, the
policy, and the tree updated with where the key went (as SGLang's router does, at
decision time: the next request with the same prefix sees it at once)."""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.runtime.protocol import Input, Tool
from radixlm.runtime.router.keys import CHARS_PER_TOKEN, estimate_tokens, input_key, scope_key
from radixlm.runtime.router.policy import Balance, choose
from radixlm.runtime.router.prefix_tree import ApproxTree

__all__ = ["Routing"]


class Routing:
    def __init__(self, balance: Balance, replicas: int, tree_cap_chars: int = 1 << 22) -> None:
        self.balance = balance
        self.tree = ApproxTree(tree_cap_chars)
        self.turn = 0
        self.loads = [0] * replicas  # tokens in flight per replica (policy.py)
        self.alive: frozenset[int] = frozenset()  # the live replicas, as a set

    @staticmethod
    def key(tenant: str | None, namespace: str | None, inp: Input | None,
            tools: list[Tool] | None) -> str:
        return scope_key(tenant, namespace) + input_key(inp, tools)

    def place(self, key: str, live: Sequence[int], inp: Input | None,
              max_tokens: int | None) -> tuple[int, int]:
        """The replica for a request with routing key `key`, and the load it adds there:
        its estimated tokens beyond the match, plus `max_tokens`."""
        match = self.tree.path(key)
        alive = self.alive if len(self.alive) == len(live) else frozenset(live)
        replica = choose(self.balance, live, alive, match, len(key), self.loads,
                         self.tree.chars, self.turn)
        self.turn += 1
        matched = match.length(replica)
        self.tree.insert(key, replica, match)
        tokens = estimate_tokens(inp, key) if inp is not None else len(key) // CHARS_PER_TOKEN
        return replica, max(0, tokens - matched // CHARS_PER_TOKEN) + (max_tokens or 0)

    def unload(self, replica: int, tokens: int) -> None:
        self.loads[replica] = max(0, self.loads[replica] - tokens)

    def flush(self, tenant: str | None) -> None:
        """A tenant flushed its cache on every replica: forget its keys."""
        self.tree.remove_prefix(f"{tenant or ''}\x00")

    def replica_gone(self, replica: int) -> None:
        self.tree.remove_replica(replica)
