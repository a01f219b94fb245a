"""Jump-forward: append the text a grammar forces without sampling it, as the tokens the
tokenizer itself would produce.

When the grammar admits exactly one continuation for the next characters (a JSON key,
``": "``, a fixed tool name), sampling them token by token wastes a decode step each.
`plan_jump` turns that forced text into tokens that the scheduler appends at once and
computes in one extend step.

The boundary problem: the forced text must be tokenized together with what precedes it,
or the tokens differ from the tokenizer's (``{"`` is one token, ``{`` then ``"`` two).
The last sampled token has no KV yet, so it may still be replaced; everything before it
is computed and stays. The plan therefore re-tokenizes ``prev + last + forced`` (``prev``
the token before the last sampled one) and uses it only when it starts with ``prev``
(the boundary before ``last`` is stable); the tokens after ``prev`` replace ``last``. The
plan's final token is dropped, since the text after the forced part may merge with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.tokenizer import Tokenizer

__all__ = ["JumpPlan", "plan_jump"]

_REPLACEMENT = "\ufffd"  # a token that decodes to part of a UTF-8 character


@dataclass(frozen=True, slots=True)
class JumpPlan:
    """Replace the last sampled token by `tokens` (their first may equal it)."""

    tokens: list[int]

    @property
    def gained(self) -> int:
        return len(self.tokens) - 1


def plan_jump(state: GrammarState, tokenizer: Tokenizer, prev: int, last: int,
              budget: int) -> JumpPlan | None:
    """Forced tokens after `last` (just sampled and accepted by `state`), or None.

    On success `state` has taken the plan's tokens in place of `last`; on None it is
    unchanged. `budget`: how many tokens the output may still grow by, `last` included.
    """
    if budget < 2 or state.terminated:
        return None
    forced = state.forced_text()
    if not forced:
        return None
    context = tokenizer.decode([prev, last])
    if _REPLACEMENT in context:
        return None
    ids = tokenizer.encode(context + forced, add_special_tokens=False)
    if len(ids) < 3 or ids[0] != prev:
        return None  # the boundary before `last` moved: the computed `prev` would be wrong
    tokens = ids[1:-1][:budget]  # the final token may merge with what follows
    if len(tokenizer.decode(tokens)) <= len(tokenizer.decode([last])):
        return None  # nothing forced survives the re-tokenization
    state.rollback(1)
    taken = state.accept_all(tokens)
    if taken < len(tokens):  # the grammar refuses this tokenization: undo, keep `last`
        state.rollback(taken)
        state.accept(last)
        return None
    return JumpPlan(tokens)

