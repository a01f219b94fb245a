"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`: Gemma, Phi-3,
Llama 2, Mistral 7B v0.1) as a `tokenizers.Tokenizer` that tokenizes as llama.cpp does.

llama.cpp's SentencePiece tokenizer (facts from its `llm_tokenizer_spm`): spaces become
"▁" (U+2581), a "▁" is put before the text and before the text after each special token
when `tokenizer.ggml.add_space_prefix` is true (its default), then adjacent pieces are
merged, always the pair whose union is the vocabulary's best-scored token, until none is
left; what is not in the vocabulary falls back to `<0xXX>` byte tokens. A BPE over the
same vocabulary does exactly that when its merges are ranked by the merged token's score
(`_merges`). Control tokens (type 3) stay whole as special tokens, user-defined ones
(type 4) as added tokens.

Gemma's files differ in two ways (as transformers' own GGUF loader notes): a token made
only of spaces is stored with real spaces ("  ") where the vocabulary's merges spell
"▁▁", and its scores do not follow the merge order, the tokens' order in the file does.
"""

from __future__ import annotations

from typing import Any

from .config import UnsupportedModelError

SPACE = "\u2581"
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_CONTROL, _USER, _BYTE = 3, 4, 6


def spm_tokenizer(meta: dict[str, Any]):
    """The `tokenizers.Tokenizer` of a GGUF's SentencePiece (`llama`) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    scores = meta.get("tokenizer.ggml.scores")
    gemma = meta.get("general.architecture") in GEMMA_ARCHS
    if gemma:
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        rank = [-float(i) for i in range(len(tokens))]  # the file's order is the merge order
    elif scores is not None:
        rank = [float(s) for s in scores]
    else:
        raise UnsupportedModelError("a SentencePiece GGUF vocabulary without scores")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    bpe = models.BPE(vocab=vocab, merges=_merges(tokens, types, rank, vocab), unk_token=unk,
                     fuse_unk=True, byte_fallback=True)  # fmt: skip
    tok = Tokenizer(bpe)
    replace = normalizers.Replace(" ", SPACE)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]  # fmt: skip
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == _USER]  # fmt: skip
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def _merges(tokens: list[str], types: list[int], rank: list[float],
            vocab: dict[str, int]) -> list[tuple[str, str]]:  # fmt: skip
    """Every split of a mergeable token into two vocabulary tokens, best merged token
    first (ties: the left part's id, then the right part's, as a stable order)."""
    found = []
    for i, t in enumerate(tokens):
        if types[i] in (_CONTROL, _USER, _BYTE) or len(t) < 2 or vocab.get(t) != i:
            continue
        for k in range(1, len(t)):
            left, right = vocab.get(t[:k]), vocab.get(t[k:])
            if left is not None and right is not None:
                found.append((-rank[i], left, right, t[:k], t[k:]))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]
