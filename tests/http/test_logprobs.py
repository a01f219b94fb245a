"""Logprob token texts over HTTP on the embedded default model (SmolLM2-135M-Instruct, a
GGUF: the HTTP process has no tokenizer of its own, and the texts are the engine's).

References: the reply's own text -- a greedy reply's logprob tokens, one per generated
token, join to exactly what it says (its content, a completion's text, an echoed prompt
and its completion) -- and the GGUF's vocabulary read by `gguf` (gguf-py) for the token
strings of /v1/tokenize. The Responses API returns no logprobs (it refuses
``top_logprobs``): nothing to check there.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Name the days of the week, one per line."}]
PROMPT = "Monday, Tuesday, Wednesday,"
TOKENS = 12


def _generated(entries: list, finish: str) -> list:
    """The entries of the reply's text: without a stop token that ended it (its text is
    left out of the reply)."""
    return entries[:-1] if finish == "stop" else entries


def test_chat_logprob_tokens_join_to_the_reply(smol) -> None:  # noqa: ANN001
    api = smol.openai()
    r = api.chat.completions.create(model=smol.model, messages=MESSAGES, max_tokens=TOKENS,
                                    temperature=0, logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in _generated(entries, choice.finish_reason)) == choice.message.content
    for e in entries:
        assert not e.token.startswith("token_id:")
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token
        assert all(not t.token.startswith("token_id:") for t in e.top_logprobs)
    # Streamed: the same tokens, chunk by chunk.
    chunks = list(api.chat.completions.create(model=smol.model, messages=MESSAGES,
                                              max_tokens=TOKENS, temperature=0, logprobs=True,
                                              top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == choice.message.content
    api.close()


def test_completion_logprob_tokens_join_to_the_text(smol) -> None:  # noqa: ANN001
    api = smol.openai()
    r = api.completions.create(model=smol.model, prompt=PROMPT, max_tokens=TOKENS,
                               temperature=0, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    tokens = _generated(lp.tokens, choice.finish_reason)
    assert "".join(tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(not t.startswith("token_id:") for t in lp.tokens)
    assert all(len(top) == 2 and all(not k.startswith("token_id:") for k in top)
               for top in lp.top_logprobs)
    # Echoed: the prompt's tokens first (its first without a logprob), then the reply's.
    echo = api.completions.create(model=smol.model, prompt=PROMPT, max_tokens=TOKENS,
                                  temperature=0, logprobs=2, echo=True).choices[0]
    assert echo.text == PROMPT + choice.text
    assert "".join(_generated(echo.logprobs.tokens, echo.finish_reason)) == echo.text
    assert echo.logprobs.token_logprobs[0] is None
    api.close()


def test_token_id_prompts_echo_and_token_strings_are_the_engines(smol) -> None:  # noqa: ANN001
    import gguf
    from radixlm.runtime.model import default_gguf_path

    s, body = smol.request("POST", "/v1/tokenize", json.dumps(
        {"prompt": PROMPT, "return_token_strs": True}).encode())
    assert s == 200, body
    ids = body["tokens"]
    field = gguf.GGUFReader(str(default_gguf_path())).fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode() for i in field.data]
    assert body["token_strs"] == [vocab[i] for i in ids]
    api = smol.openai()
    by_ids = api.completions.create(model=smol.model, prompt=ids, max_tokens=4, temperature=0,
                                    echo=True).choices[0]
    assert by_ids.text.startswith(PROMPT)
    api.close()
