"""`Grammars`: what the scheduler needs for constrained requests, in one object.

Compilation (cached, off the loop), a fresh `GrammarState` per sequence, the batch mask
for a sampling step, and `advance`: take a sampled token and, when the grammar then
forces text, the jump-forward tokens that replace it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from radixlm.runtime.grammar.bitmask import BatchMasker, TokenMask
from radixlm.runtime.grammar.compiler import (
    DEFAULT_TIMEOUT_S,
    CompiledGrammar,
    CompilingGrammar,
    GrammarCompiler,
)
from radixlm.runtime.grammar.jump_forward import plan_jump
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.tokenizer import Tokenizer

__all__ = ["Grammars"]


class Grammars:
    """One per engine. `jump_forward=False` samples every token (benchmarks compare)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int],
                 *, jump_forward: bool = True, compiler: GrammarCompiler | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        stop = frozenset(eos_ids)
        self.tokenizer = tokenizer
        self.compiler = compiler or GrammarCompiler(
            lambda: tokenizer_info(tokenizer, vocab_size, stop), timeout_s=timeout_s)
        self.masker = BatchMasker(vocab_size)
        self.jump_forward = jump_forward

    def get(self, spec: GrammarSpec, *, owner: Hashable = None,
            party: Hashable = None) -> CompiledGrammar | CompilingGrammar:
        """`owner`: the cache partition (a tenant's namespace); `party`: whose share of
        the compile threads (see `GrammarCompiler.get`)."""
        return self.compiler.get(spec, owner=owner, party=party)

    @staticmethod
    def new_state(compiled: CompiledGrammar, stop_ids: Iterable[int]) -> GrammarState:
        return GrammarState(compiled, stop_ids)

    def mask(self, states: Sequence[GrammarState | None]) -> TokenMask | None:
        return self.masker.fill(states)

    def advance(self, state: GrammarState, prev: int, token: int, budget: int,
                jump: bool) -> list[int] | None:
        """Accept the sampled `token`; returns the tokens to append in its place (itself,
        or a jump-forward run starting with its text), or None when the grammar refuses it.
        `prev`: the token before it (computed); `budget`: how many tokens may still be
        appended, `token` included."""
        if not state.accept(token):
            return None
        if not (jump and self.jump_forward) or budget < 2:
            return [token]
        plan = plan_jump(state, self.tokenizer, prev, token, budget)
        return [token] if plan is None else plan.tokens

    def close(self) -> None:
        self.compiler.close()
