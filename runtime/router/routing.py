"""The routing decision for new work, kept apart from sockets so that it can be measured
alone (benchmarks/bench_router.py, the routing-cost row): a key, a tree match, the
policy, and the tree updated with where the key went (as SGLang's router does, at
decision time: the next request with the same prefix sees it at once)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from radixlm.runtime.protocol import Input, Tool
from radixlm.runtime.router.keys import CHARS_PER_TOKEN, estimate_tokens, input_key, scope_key
from radixlm.runtime.router.policy import Balance, choose
from radixlm.runtime.router.prefix_tree import ApproxTree

__all__ = ["Routing"]


class Loaded(Protocol):
    load: int


class Routing:
    def __init__(self, balance: Balance, replicas: int, tree_cap_chars: int = 1 << 22) -> None:
        self.balance = balance
        self.tree = ApproxTree(tree_cap_chars)
        self.turn = 0
        self.replicas = replicas

    @staticmethod
    def key(tenant: str | None, namespace: str | None, inp: Input | None,
            tools: list[Tool] | None) -> str:
        return scope_key(tenant, namespace) + input_key(inp, tools)

    @staticmethod
    def estimate(inp: Input | None, max_tokens: int | None) -> int:
        """Tokens a request adds to its replica's load (its input and what it may generate)."""
        return estimate_tokens(inp, input_key(inp)) + (max_tokens or 0)

    def place(self, key: str, live: Sequence[int], inp: Input | None, max_tokens: int | None,
              replicas: Sequence[Loaded]) -> tuple[int, int]:
        """The replica for a request with routing key `key`, and the load it adds there:
        its estimated tokens beyond the match, plus `max_tokens`."""
        matched = self.tree.match(key)
        loads = {i: replicas[i].load for i in live}
        replica = choose(self.balance, live, matched, len(key), loads, self.tree.chars,
                         self.turn)
        self.turn += 1
        self.tree.insert(key, replica)
        tokens = estimate_tokens(inp, key) if inp is not None else len(key) // CHARS_PER_TOKEN
        return replica, max(0, tokens - matched.get(replica, 0) // CHARS_PER_TOKEN) + (
            max_tokens or 0)

    def flush(self, tenant: str | None) -> None:
        """A tenant flushed its cache on every replica: forget its keys."""
        self.tree.remove_prefix(f"{tenant or ''}\x00")

    def replica_gone(self, replica: int) -> None:
        self.tree.remove_replica(replica)
