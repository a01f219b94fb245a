"""`GrammarState`: one sequence's position in its grammar.

Each sequence owns one (an ``n > 1`` branch or a forked session continues from a copy,
`fork`). The state advances by exactly the tokens appended to the sequence's output, so
a retracted request that is recomputed keeps its state (its output tokens are kept);
`rollback` undoes accepted tokens (a jump-forward that re-tokenizes the last sampled
token).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the compiler before any state exists
    import xgrammar as xgr

__all__ = ["GrammarState"]


class GrammarState:
    """Wraps an xgrammar matcher; `accepted` counts the tokens it has taken."""

    __slots__ = ("accepted", "matcher")

    def __init__(self, compiled: xgr.CompiledGrammar | None, stop_ids: Iterable[int] = (),
                 *, _matcher: xgr.GrammarMatcher | None = None, _accepted: int = 0) -> None:
        if _matcher is None:
            assert compiled is not None
            # Stop ids end the output once the grammar is complete (and only then).
            stops = sorted(stop_ids)
            import xgrammar as xgr

            _matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.matcher = _matcher
        self.accepted = _accepted

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar refuses it."""
        ok = self.matcher.accept_token(int(token_id))
        if ok:
            self.accepted += 1
        return ok

    def accept_all(self, token_ids: Iterable[int]) -> int:
        """Accept tokens in order until one is refused; returns how many were taken."""
        taken = 0
        for t in token_ids:
            if not self.accept(t):
                break
            taken += 1
        return taken

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.accepted -= n

    def fork(self) -> GrammarState:
        return GrammarState(None, _matcher=self.matcher.fork(), _accepted=self.accepted)

    @property
    def complete(self) -> bool:
        """The output so far is a whole match (a stop token may end it now)."""
        return self.matcher.is_completed()

    @property
    def terminated(self) -> bool:
        """A stop token was accepted, or the grammar admits nothing more."""
        return self.matcher.is_terminated()

    def forced_text(self) -> str:
        """The longest text every continuation of the output starts with (complete UTF-8
        characters only; "" when the next character is a choice)."""
        return self.matcher.find_jump_forward_string()
