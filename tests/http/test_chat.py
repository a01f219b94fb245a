"""/v1/chat/completions and /v1/completions through the real `openai` client.

References: the engine spoken to directly over the protocol (RawClient: the same
generation without the HTTP layer) and the HF tokenizer (prompt lengths)."""

from __future__ import annotations

import uuid

import pytest
from radixlm.runtime.protocol import Input, Message

pytestmark = pytest.mark.timeout(120)


def _hf_prompt_len(model_dir, messages) -> int:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _direct(http_server, messages, **sampling):  # noqa: ANN001, ANN202
    with http_server.server.client(timeout_s=60) as raw:
        return raw.generate(Input(messages=[Message(**m) for m in messages]), **sampling)


def test_chat_matches_the_engine_and_counts_the_prompt(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Hello {uuid.uuid4().hex[:6]}"}]
    r = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=12,
                                    temperature=0)
    done = _direct(http_server, messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == http_server.model
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == done.text
    assert r.choices[0].finish_reason == ("length" if done.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == _hf_prompt_len(http_server.model_dir, messages)
    assert r.usage.completion_tokens == len(done.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The same prompt again: all of it but the last token (whose logits are needed) cached.
    again = api.chat.completions.create(model=http_server.model, messages=messages,
                                        max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_stream_concatenates_to_the_same_reply(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": f"Tell me {uuid.uuid4().hex[:6]}"}]
    whole = api.chat.completions.create(model=http_server.model, messages=messages,
                                        max_tokens=16, temperature=0)
    chunks = list(api.chat.completions.create(
        model=http_server.model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stop_n_seed_and_penalties(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Count: one two three"}]
    free = api.chat.completions.create(model=http_server.model, messages=messages,
                                       max_tokens=20, temperature=0)
    text = free.choices[0].message.content
    if len(text) >= 4:  # stop at a piece of the free reply: the reply ends just before it
        stop = text[2:4]
        cut = api.chat.completions.create(model=http_server.model, messages=messages,
                                          max_tokens=20, temperature=0, stop=[stop])
        assert cut.choices[0].message.content == text[:text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
    a = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=8,
                                    n=3, seed=7, temperature=1.0, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, user="u1")
    b = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=8,
                                    n=3, seed=7, temperature=1.0, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # Branch i of n samples with seed + i (the protocol's rule): the engine, asked directly.
    assert [c.message.content for c in a.choices] == [
        _direct(http_server, messages, max_tokens=8, seed=7 + i, temperature=1.0, top_p=0.9,
                presence_penalty=0.5, frequency_penalty=0.5).text for i in range(3)]


def test_logprobs_are_the_engines(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Logprobs please"}]
    r = api.chat.completions.create(model=http_server.model, messages=messages, max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=3)
    done = _direct(http_server, messages, max_tokens=6, temperature=0, logprobs=True,
                   top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(done.logprobs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(http_server.model_dir))
    assert [c.token for c in content] == [tok.decode([t]) for t in done.token_ids]
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy: the top one
        assert c.bytes == list(c.token.encode())
    streamed = [c for c in api.chat.completions.create(
        model=http_server.model, messages=messages, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=2, stream=True) if c.choices and c.choices[0].logprobs]
    lps = [x.logprob for c in streamed for x in c.choices[0].logprobs.content]
    assert lps == pytest.approx(done.logprobs)


def test_developer_role_and_text_parts(http_server, api) -> None:  # noqa: ANN001
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Wea"},
                                          {"type": "text", "text": "ther?"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    a = api.chat.completions.create(model=http_server.model, messages=parts, max_tokens=4,
                                    temperature=0)
    b = api.chat.completions.create(model=http_server.model, messages=plain, max_tokens=4,
                                    temperature=0)
    assert a.usage.prompt_tokens == _hf_prompt_len(http_server.model_dir, plain)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_text_ids_echo_and_logprobs(http_server, api) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(http_server.model_dir))
    prompt = "The quick brown fox"
    r = api.completions.create(model=http_server.model, prompt=prompt, max_tokens=6,
                               temperature=0)
    with http_server.server.client(timeout_s=60) as raw:
        done = raw.generate(Input(text=prompt), max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == done.text
    assert r.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    ids = tok(prompt)["input_ids"]
    by_ids = api.completions.create(model=http_server.model, prompt=ids, max_tokens=6,
                                    temperature=0)
    assert by_ids.choices[0].text == done.text
    echo = api.completions.create(model=http_server.model, prompt=prompt, max_tokens=6,
                                  temperature=0, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == prompt + done.text
    assert lp.tokens == [tok.decode([t]) for t in ids + done.token_ids]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + len(done.token_ids)
    assert lp.text_offset[len(ids)] == len(prompt)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    batch = api.completions.create(model=http_server.model, prompt=[prompt, ids], max_tokens=6,
                                   temperature=0)
    assert [c.text for c in batch.choices] == [done.text, done.text]
    streamed = api.completions.create(model=http_server.model, prompt=prompt, max_tokens=6,
                                      temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.text


def test_models_and_health(http_server, api) -> None:  # noqa: ANN001
    models = api.models.list()
    assert [m.id for m in models.data] == [http_server.model]
    status, body = http_server.request("GET", "/health", key=None)  # no key needed
    assert status == 200 and body["status"] == "ok"


def test_model_info_names_the_engine_and_runtime_endpoint_connects_through_it(http_server) -> None:  # noqa: ANN001
    """SGLang's /get_model_info (its RuntimeEndpoint's first call), with the engine's
    protocol endpoint: ``rl.RuntimeEndpoint(url)`` runs programs on that engine."""
    import radixlm as rl

    status, body = http_server.request("GET", "/get_model_info")
    assert status == 200 and body["radixlm_endpoint"] == http_server.server.endpoint
    assert http_server.request("GET", "/get_model_info", key=None)[0] == 401
    with pytest.raises(rl.EngineDeadError, match="api_key"):
        rl.RuntimeEndpoint(http_server.url)
    with rl.RuntimeEndpoint(http_server.url, api_key=http_server.api_key) as backend:
        assert backend.endpoint == http_server.server.endpoint
        assert backend.get_model_name() == body["model_path"]
