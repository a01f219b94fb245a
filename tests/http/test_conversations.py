"""Responses semantics (instructions), the Conversations API, held histories found again
from a re-sent input, GET /v1/models/{id}, tokenize/detokenize and optional ``model``,
through the `openai` client.

References: transformers' `apply_chat_template` + tokenizer for what a prompt must hold
(its token count), and the previous turn's ``input_tokens + output_tokens`` for what a
continued turn must find cached (its whole history, nothing recomputed).
"""

from __future__ import annotations

import uuid

import openai
import pytest

pytestmark = pytest.mark.timeout(180)


def _history(r) -> int:  # noqa: ANN001
    return r.usage.input_tokens + r.usage.output_tokens


@pytest.fixture(scope="module")
def hf_tok(http_server):  # noqa: ANN001, ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(http_server.model_dir))


def _render_len(tok, messages: list[dict]) -> int:  # noqa: ANN001
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_instructions_are_never_carried_over(http_server, api, hf_tok) -> None:  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    kw = dict(model=http_server.model, max_output_tokens=5, temperature=0)
    first = api.responses.create(input=f"Hello {tag}", instructions="Be brief.", **kw)
    assert first.instructions == "Be brief."
    user1 = {"role": "user", "content": f"Hello {tag}"}
    reply1 = {"role": "assistant", "content": first.output_text}
    assert first.usage.input_tokens == _render_len(hf_tok, [
        {"role": "system", "content": "Be brief."}, user1])
    # Same instructions again: the whole held history is cached.
    same = api.responses.create(input="More", instructions="Be brief.",
                                previous_response_id=first.id, **kw)
    assert same.usage.input_tokens_details.cached_tokens == _history(first)
    # New instructions: the new system prompt, the old one gone (a full render).
    new = api.responses.create(input="More", instructions="Be verbose.",
                               previous_response_id=first.id, **kw)
    assert new.instructions == "Be verbose."
    assert new.usage.input_tokens == _render_len(hf_tok, [
        {"role": "system", "content": "Be verbose."}, user1, reply1,
        {"role": "user", "content": "More"}])
    # None at all: no system prompt.
    bare = api.responses.create(input="More", previous_response_id=first.id, **kw)
    assert bare.usage.input_tokens == _render_len(hf_tok, [user1, reply1,
                                                           {"role": "user", "content": "More"}])
    # A chain keeps its own instructions' history: continuing `new` with them hits it.
    deeper = api.responses.create(input="Go on", instructions="Be verbose.",
                                  previous_response_id=new.id, **kw)
    assert deeper.usage.input_tokens_details.cached_tokens == _history(new)


def test_a_resent_history_continues_the_held_session(http_server, api) -> None:  # noqa: ANN001
    """A stateless client (openai-agents' sessions, or any that keeps its own history)
    sends everything again: the turn still computes only its new tokens."""
    tag = uuid.uuid4().hex[:8]
    kw = dict(model=http_server.model, max_output_tokens=5, temperature=0, instructions="Hi.")
    r1 = api.responses.create(input=f"One {tag}", **kw)
    items = [{"role": "user", "content": f"One {tag}"},
             *[o.model_dump(exclude_none=True) for o in r1.output]]
    r2 = api.responses.create(input=[*items, {"role": "user", "content": "Two"}], **kw)
    assert r2.usage.input_tokens_details.cached_tokens == _history(r1)
    items += [{"role": "user", "content": "Two"},
              *[o.model_dump(exclude_none=True) for o in r2.output]]
    r3 = api.responses.create(input=[*items, {"role": "user", "content": "Three"}], **kw)
    assert r3.usage.input_tokens_details.cached_tokens == _history(r2)
    # store: false keeps nothing to continue: the next turn renders everything again.
    quiet = api.responses.create(input=f"Quiet {tag}", store=False, **kw)
    again = api.responses.create(input=[{"role": "user", "content": f"Quiet {tag}"},
                                        *[o.model_dump(exclude_none=True) for o in quiet.output],
                                        {"role": "user", "content": "Next"}], **kw)
    assert again.usage.input_tokens_details.cached_tokens < _history(quiet)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(quiet.id)


def test_conversations_api(http_server, api) -> None:  # noqa: ANN001
    conv = api.conversations.create(items=[{"type": "message", "role": "user",
                                            "content": "Remember 7."}],
                                    metadata={"topic": "numbers"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "numbers"}
    assert api.conversations.retrieve(conv.id).id == conv.id
    assert api.conversations.update(conv.id, metadata={"topic": "n"}).metadata == {"topic": "n"}
    kw = dict(model=http_server.model, max_output_tokens=5, temperature=0, conversation=conv.id)
    r1 = api.responses.create(input="What number?", **kw)
    r2 = api.responses.create(input="And doubled?", **kw)
    assert r2.usage.input_tokens_details.cached_tokens == _history(r1)
    items = list(api.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"),
                                                 ("message", "assistant"), ("message", "user"),
                                                 ("message", "assistant")]
    assert items[2].content[0].text == r1.output_text and items[4].id == r2.output[0].id
    # Paging: newest first by default, `after` and `limit`.
    page = api.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in page.data] == [items[4].id, items[3].id] and page.has_more
    rest = api.conversations.items.list(conv.id, limit=10, after=items[3].id)
    assert [i.id for i in rest.data] == [i.id for i in items[2::-1]] and not rest.has_more
    assert api.conversations.items.retrieve(items[1].id, conversation_id=conv.id).id == items[1].id
    # Adding items by hand continues the conversation as well.
    added = api.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "Thanks"},
        {"type": "message", "role": "assistant", "content": "Welcome"}])
    assert len(added.data) == 2
    r3 = api.responses.create(input="Bye", **kw)
    assert _history(r2) <= r3.usage.input_tokens_details.cached_tokens < r3.usage.input_tokens
    api.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(list(api.conversations.items.list(conv.id))) == 8
    with pytest.raises(openai.BadRequestError):
        api.responses.create(input="x", previous_response_id=r1.id, **kw)
    assert api.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        api.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(input="x", **kw)
    with pytest.raises(openai.BadRequestError):
        api.conversations.create(items=[{"type": "reasoning", "summary": []}])


def test_input_items_of_a_response(http_server, api) -> None:  # noqa: ANN001
    r = api.responses.create(model=http_server.model, max_output_tokens=3, temperature=0,
                             input=[{"role": "user", "content": "a"},
                                    {"role": "user", "content": "b"}])
    got = api.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in got.data] == ["a", "b"]


def test_models_by_id_and_requests_without_a_model(http_server, api) -> None:  # noqa: ANN001
    m = api.models.retrieve(http_server.model)
    assert m.id == http_server.model and m.model_extra["context_length"] == 2048
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("no-such-model")
    s, body = http_server.request("POST", "/v1/chat/completions", b'{"messages": [{"role": '
                                  b'"user", "content": "hi"}], "max_tokens": 2}')
    assert s == 200 and body["model"] == http_server.model
    s, body = http_server.request("POST", "/v1/responses", b'{"input": "hi", '
                                  b'"max_output_tokens": 2}')
    assert s == 200 and body["status"] in ("completed", "incomplete")


def test_tokenize_and_detokenize(http_server, hf_tok) -> None:  # noqa: ANN001
    import json

    s, body = http_server.request("POST", "/v1/tokenize", json.dumps(
        {"prompt": "Hello radix trees"}).encode())
    assert s == 200 and body["tokens"] == hf_tok("Hello radix trees", add_special_tokens=False)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    messages = [{"role": "user", "content": "Hi there"}]
    s, chat = http_server.request("POST", "/tokenize", json.dumps(
        {"messages": messages, "return_token_strs": True}).encode())
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert s == 200 and chat["tokens"] == hf_tok(want, add_special_tokens=False)["input_ids"]
    assert chat["token_strs"] == hf_tok.convert_ids_to_tokens(chat["tokens"])
    s, text = http_server.request("POST", "/v1/detokenize", json.dumps(
        {"tokens": chat["tokens"]}).encode())
    assert s == 200 and text["prompt"] == want
    s, err = http_server.request("POST", "/v1/detokenize", b'{"tokens": [99999999]}')
    assert s == 400 and err["error"]["code"] == "invalid_value"
    s, err = http_server.request("POST", "/v1/tokenize", b'{"prompt": "a", "messages": []}')
    assert s == 400


def test_max_tokens_defaults_to_what_is_left_of_the_context(http_server, api, hf_tok) -> None:  # noqa: ANN001
    """A prompt of most of the 2,048-token context, no max_tokens: it runs (vLLM's
    default), and cannot run past the context."""
    words = " ".join(f"w{i}" for i in range(4000))
    ids = hf_tok(words, add_special_tokens=False)["input_ids"][:1990]
    text = hf_tok.decode(ids)
    r = api.completions.create(model=http_server.model, prompt=text, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 2048
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model=http_server.model, prompt=ids * 2, temperature=0)
    assert e.value.code == "context_length_exceeded"
