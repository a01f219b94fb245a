"""The token mask of a whole batch: filled for every constrained row in one call, applied
to the logits in one pass (xgrammar's CPU kernel, or its CUDA one for CUDA logits)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlm.runtime.grammar.matcher import GrammarState

__all__ = ["BatchMasker", "TokenMask"]


class TokenMask:
    """Allowed tokens for some rows of a logits batch (`rows`); other rows are free."""

    __slots__ = ("bitmask", "rows")

    def __init__(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.bitmask = bitmask
        self.rows = rows

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Forbidden tokens of the masked rows set to -inf, in place when `logits` is
        contiguous (returned either way)."""
        if not logits.is_contiguous():
            logits = logits.contiguous()
        bitmask = self.bitmask if logits.device == self.bitmask.device else (
            self.bitmask.to(logits.device, non_blocking=True))
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                        indices=self.rows)
        return logits


class BatchMasker:
    """Fills one int32 bitmask ``[rows, ceil(vocab/32)]`` per step for a batch's grammar
    states; the buffer is reused (grown as batches grow). Made at the first constrained
    batch (xgrammar is imported by then: a state exists)."""

    def __init__(self, vocab_size: int, threads: int | str = 1) -> None:
        self.vocab_size = vocab_size
        self.threads = threads
        self._buffer: torch.Tensor | None = None
        self._batch: Any = None

    def fill(self, states: Sequence[GrammarState | None]) -> TokenMask | None:
        """The mask for a batch whose row i is constrained by ``states[i]`` (None: free)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
        if self._buffer is None or self._buffer.shape[0] < len(states):
            have = 4 if self._buffer is None else self._buffer.shape[0]
            self._buffer = xgr.allocate_token_bitmask(max(len(states), 2 * have), self.vocab_size)
        bitmask = self._buffer[: len(states)]
        matchers = [states[i].matcher for i in rows]  # type: ignore[union-attr]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        return TokenMask(bitmask, rows)
