"""The tokenizer as xgrammar sees it: each token's bytes, its vocabulary type, stop ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlm.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["tokenizer_info"]


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` over `vocab_size` ids (the model's logits width,
    which may exceed the tokenizer's: ids past it are never allowed).

    xgrammar reads the vocabulary and its decoder type from a transformers fast
    tokenizer; wrapping our `tokenizers` backend in one costs no file reads.
    """
    import xgrammar as xgr  # heavy imports (xgrammar, transformers): only when grammars run
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=max(vocab_size, tokenizer.vocab_size), stop_token_ids=sorted(stop_ids)
    )
