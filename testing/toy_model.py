"""The stub's toy model: characters as tokens, a deterministic next token and logprob
(so tests can recompute every result independently), and ChatML as its chat template.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

__all__ = ["ALPHABET", "CONTEXT_LENGTH", "EOS", "IM_END", "IM_START", "decode", "encode_text",
           "render_chatml", "toy_logprob", "toy_next_token"]

EOS = 0  # the toy model's end-of-sequence token id
ALPHABET = "abcdefghij klmnop."  # what the toy model writes
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML markers of the stub's template
CONTEXT_LENGTH = 8192  # the stub's context length (its Welcome says so)


def toy_next_token(seq: list[int], branch: int = 0, banned: Collection[int] = ()) -> int:
    """The toy model's next token after `seq`: EOS now and then, else a letter. A token in
    `banned` (masked, as ``min_tokens`` masks EOS and stop ids) gives way to the next
    letter of the alphabet that is not."""
    h = (sum(seq[-3:]) * 31 + len(seq) * 7 + branch * 13) % 101
    token = EOS if h == 0 else ord(ALPHABET[h % len(ALPHABET)])
    if banned:
        i = h
        while token in banned:
            i += 1
            token = ord(ALPHABET[i % len(ALPHABET)])
    return token


def toy_logprob(context: list[int], token: int) -> float:
    """The toy model's log-probability of `token` after `context` (in [-10, 0))."""
    h = ((sum(context[-2:]) + 3 * token) * 2654435761) % 1000
    return -(h + 1) / 100.0


def render_chatml(messages: list[Any], add_generation_prompt: bool) -> str:
    """The stub's chat template (ChatML) over protocol `Message`s, as text."""
    text = "".join(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def encode_text(text: str) -> list[int]:
    """A text's toy tokens: one per character (its code point)."""
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    """The text of toy tokens (EOS has none)."""
    return "".join(chr(t) for t in ids if t != EOS)
