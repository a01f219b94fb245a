"""Gemma 3 sessions through a real server: a history several sliding windows long stays
token-exact and wholly cached, turn after turn, and so do its forks.

A tiny random Gemma 3 (window 16, every other layer sliding, Gemma's special tokens and
Gemma 3's chat template) serves an 8-turn session opened with a system message. Each turn:

- its prompt is, token for token, `apply_chat_template` of the conversation so far
  (transformers' tokenizer; each reply stands as the tokens the model produced), read
  back from the cache: a plain request for that sequence plus one token finds all of it
  cached, which only this turn's prompt can have put there;
- it hits the whole history (`cached_tokens` == the session's length before the turn);
- its reply is transformers' greedy continuation of that prompt (every layer of the
  model, windows included, sees what a cache-less forward sees).

Then the session is forked in two and each branch continues the same way. The pool's
accounting (free + evictable + protected == capacity) is checked after every turn. Page
sizes 1 (the default: the whole history hit) and 16 (its whole pages hit, as for every
model: the prefix tree caches whole pages).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import scheduler_harness as harness
import torch
from conftest import assert_pool_clean, start_test_server
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
    FlushCache,
    ForkSession,
    Input,
    Message,
    Ok,
    OpenSession,
    SessionOpened,
    SessionsForked,
)
from radixlm.runtime.transport.raw_client import RawClient

WINDOW = 16
TURNS = 8
REPLY = 10  # tokens per reply
SYSTEM = "Answer in short words."
QUESTIONS = [
    "Hello world! How are you today?", "What is the weather like?",
    "Name the quick brown fox.", "Once upon a time there was a model.",
    "Which prompt prefix does the radix tree keep?", "def main(): print it.",
    "1234567890 + 42 = ?", "Sessions fork and join; tools are called with JSON.",
    "And the lazy dog?", "Thank you.",
]  # fmt: skip


one_thread = harness.one_thread  # tiny models run single-threaded (autouse)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma3"), "gemma3", name="gemma3-sessions", seed=5,
        chat="gemma", num_hidden_layers=4, sliding_window=WINDOW, sliding_window_pattern=2,
        max_position_embeddings=1024, rope_local_base_freq=1000.0, tie_word_embeddings=True,
    )  # fmt: skip
    return model_dir


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def client(request, tmp_path_factory: pytest.TempPathFactory,
           model_dir: Path) -> Iterator[tuple[RawClient, int]]:  # fmt: skip
    page = request.param
    with (start_test_server(tmp_path_factory.mktemp("server"), model_dir, "--page-size", str(page))
          as server, server.client(timeout_s=120) as client):  # fmt: skip
        yield client, page


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> tuple[Any, Any]:
    import transformers
    from tiny_models import load_hf_model

    return transformers.AutoTokenizer.from_pretrained(str(model_dir)), load_hf_model(model_dir)


class Conversation:
    """The messages of a session with each reply kept as its tokens."""

    def __init__(self, turns: list[tuple[str, list[int]]] | None = None) -> None:
        self.turns = list(turns or [])  # (user message, reply tokens)

    def prompt(self, tok: Any, question: str) -> list[int]:
        """`apply_chat_template` of the conversation + `question`, replies as their tokens."""
        messages = [{"role": "system", "content": SYSTEM}]
        marks = [f"\x00REPLY{i}\x00" for i in range(len(self.turns))]
        for (user, _), mark in zip(self.turns, marks, strict=True):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": mark}]
        messages.append({"role": "user", "content": question})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids: list[int] = []
        for (_, reply), mark in zip(self.turns, marks, strict=True):
            before, text = text.split(mark)
            ids += tok.encode(before, add_special_tokens=False) + reply
        return ids + tok.encode(text, add_special_tokens=False)


@torch.no_grad()
def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def turn(c: RawClient, page: int, hf: tuple[Any, Any], session: str, conv: Conversation,
         question: str, history: int) -> Done:  # fmt: skip
    """One turn of `session` (history `history` tokens long), checked as the module says."""
    tok, model = hf
    first = not conv.turns
    messages = [Message(role="system", content=SYSTEM)] if first else []
    messages.append(Message(role="user", content=question))
    done = c.generate(Input(messages=messages), session=session, max_tokens=REPLY,
                      temperature=0.0, ignore_eos=True)  # fmt: skip
    expected = conv.prompt(tok, question)
    # The whole history (with pages of P > 1 tokens, its whole pages: the engine keeps a
    # session's history in the tree, which caches whole pages, for every model alike).
    assert done.usage.cached_tokens == history // page * page, "the turn missed its history"
    assert done.usage.prompt_tokens == len(expected)
    assert done.token_ids == greedy(model, expected, REPLY)
    assert done.session_length == len(expected) + REPLY
    assert_pool_clean(c)
    # The prompt is `expected` itself: only it can have cached all of `expected` (the
    # tree caches whole pages: all of them).
    probe = c.generate(Input(input_ids=[*expected, 5]), max_tokens=1, temperature=0.0)
    assert probe.usage.cached_tokens == len(expected) // page * page
    conv.turns.append((question, list(done.token_ids)))
    return done


def test_eight_turns_and_forks_stay_exact_and_fully_cached(client, hf) -> None:
    c, page = client
    opened = c.call(OpenSession(rid=c.new_rid("open")))
    assert isinstance(opened, SessionOpened)
    conv, history = Conversation(), 0
    for i in range(TURNS):
        done = turn(c, page, hf, opened.session, conv, QUESTIONS[i], history)
        history = done.session_length
    assert history > 12 * WINDOW  # the history spans many windows
    forked = c.call(ForkSession(rid=c.new_rid("fork"), session=opened.session, n=2))
    assert isinstance(forked, SessionsForked) and forked.length == history
    c.call(CloseSession(rid=c.new_rid("close"), session=opened.session))
    for k, session in enumerate(forked.sessions):
        # Only the held history stays cached: the other branch's prompts share the
        # markup after it and would count as cached too (so each branch is closed after
        # its turns, and the cache flushed before the next).
        assert isinstance(c.call(FlushCache(rid=c.new_rid("flush"))), Ok)
        branch = Conversation(conv.turns)
        done = turn(c, page, hf, session, branch, QUESTIONS[TURNS + k], history)
        turn(c, page, hf, session, branch, QUESTIONS[k], done.session_length)
        c.call(CloseSession(rid=c.new_rid("close"), session=session))
    assert_pool_clean(c)
