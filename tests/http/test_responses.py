"""/v1/responses with previous_response_id (engine sessions), and the chat ``session``
extension, through the real `openai` client.

The reference for "nothing recomputed": a continued response's cached tokens equal the
previous response's whole history (its input + output tokens), and its input tokens are
that history plus the new input rendered as a delta by the HF chat template."""

from __future__ import annotations

import uuid

import openai
import pytest

pytestmark = pytest.mark.timeout(120)


def _history(r) -> int:  # noqa: ANN001
    return r.usage.input_tokens + r.usage.output_tokens


def _turn_len(model_dir, text: str) -> int:  # noqa: ANN001
    """Tokens of one user message appended to a history, with the assistant header (the
    tiny model's ChatML template renders each message on its own)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
    return len(tok(rendered, add_special_tokens=False)["input_ids"])


def test_chain_four_deep_hits_the_whole_history(http_server, api) -> None:  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    r = api.responses.create(model=http_server.model, input=f"Start {tag}",
                             instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    chain = [r]
    for turn in range(3):
        text = f"Next {turn} {tag}"
        # Instructions are never carried over: a chain re-sends them (as openai-agents
        # does every turn) and still continues the held history.
        nxt = api.responses.create(model=http_server.model, input=text, instructions="Be brief.",
                                   previous_response_id=chain[-1].id, max_output_tokens=6,
                                   temperature=0)
        prev = chain[-1]
        assert nxt.previous_response_id == prev.id
        # No re-render, no re-tokenization: the whole previous history is a cache hit...
        assert nxt.usage.input_tokens_details.cached_tokens == _history(prev)
        # ... and the input is that history plus the new message only. (A reply ended by
        # EOS already closed the assistant turn; one cut by max_output_tokens gets its
        # closing tokens rendered before the new message.)
        added = nxt.usage.input_tokens - _history(prev)
        assert added in (_turn_len(http_server.model_dir, text),
                         _turn_len(http_server.model_dir, text) + 2)
        chain.append(nxt)
    got = api.responses.retrieve(chain[-1].id)
    assert got.id == chain[-1].id and got.output_text == chain[-1].output_text


def test_two_responses_fork_the_same_previous(http_server, api) -> None:  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    base = api.responses.create(model=http_server.model, input=f"Root {tag}",
                                max_output_tokens=5, temperature=0)
    a = api.responses.create(model=http_server.model, input="Branch A",
                             previous_response_id=base.id, max_output_tokens=5, temperature=0)
    b = api.responses.create(model=http_server.model, input="Branch B, longer",
                             previous_response_id=base.id, max_output_tokens=5, temperature=0)
    assert a.usage.input_tokens_details.cached_tokens == _history(base)
    # b also finds the template markup that a's input put after the shared history.
    assert _history(base) <= b.usage.input_tokens_details.cached_tokens < b.usage.input_tokens
    # The parent is untouched by its children: continuing it again hits the same history.
    a2 = api.responses.create(model=http_server.model, input="Branch A",
                              previous_response_id=base.id, max_output_tokens=5, temperature=0)
    assert a2.output_text == a.output_text and a2.usage.input_tokens == a.usage.input_tokens
    # A child continues its own history, not its sibling's.
    c = api.responses.create(model=http_server.model, input="Deeper",
                             previous_response_id=b.id, max_output_tokens=5, temperature=0)
    assert c.usage.input_tokens_details.cached_tokens == _history(b)


def test_streamed_response_events(http_server, api) -> None:  # noqa: ANN001
    base = api.responses.create(model=http_server.model, input=f"S {uuid.uuid4().hex[:8]}",
                                max_output_tokens=5, temperature=0)
    events = list(api.responses.create(model=http_server.model, input="Go on", stream=True,
                                       previous_response_id=base.id, max_output_tokens=8,
                                       temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert final.usage.input_tokens_details.cached_tokens == _history(base)
    # The streamed response was stored like any other: it can be continued.
    more = api.responses.create(model=http_server.model, input="And?", max_output_tokens=3,
                                previous_response_id=final.id, temperature=0)
    assert more.usage.input_tokens_details.cached_tokens == _history(final)


def test_store_false_and_delete(http_server, api) -> None:  # noqa: ANN001
    base = api.responses.create(model=http_server.model, input=f"K {uuid.uuid4().hex[:8]}",
                                max_output_tokens=4, temperature=0)
    temp = api.responses.create(model=http_server.model, input="Not kept", store=False,
                                previous_response_id=base.id, max_output_tokens=4, temperature=0)
    assert temp.usage.input_tokens_details.cached_tokens == _history(base)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(temp.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=http_server.model, input="x", previous_response_id=temp.id)
    alone = api.responses.create(model=http_server.model, input="Alone", store=False,
                                 max_output_tokens=3, temperature=0)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(alone.id)
    api.responses.delete(base.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(base.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=http_server.model, input="x", previous_response_id=base.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(base.id)


def test_input_items(http_server, api) -> None:  # noqa: ANN001
    r = api.responses.create(model=http_server.model, max_output_tokens=4, temperature=0, input=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say "},
                                     {"type": "input_text", "text": "something"}]},
    ])
    same = api.responses.create(model=http_server.model, max_output_tokens=4, temperature=0,
                                instructions="Be brief.", input="Say something")
    assert (r.usage.input_tokens, r.output_text) == (same.usage.input_tokens, same.output_text)
    nxt = api.responses.create(model=http_server.model, previous_response_id=r.id,
                               max_output_tokens=4, temperature=0, input=[
                                   {"type": "message", "role": "user", "content": "More"}])
    assert nxt.usage.input_tokens_details.cached_tokens == _history(r)


def test_chat_session_extension(http_server, api) -> None:  # noqa: ANN001
    tag = uuid.uuid4().hex[:8]
    first = api.chat.completions.create(
        model=http_server.model, messages=[{"role": "user", "content": f"Hi {tag}"}],
        max_tokens=5, temperature=0, extra_body={"session": {}})
    session = first.model_extra["session"]
    assert session["length"] == first.usage.prompt_tokens + first.usage.completion_tokens
    # Continue in place: only the new message is sent, the history is all cached.
    second = api.chat.completions.create(
        model=http_server.model, messages=[{"role": "user", "content": "Again"}],
        max_tokens=5, temperature=0, extra_body={"session": {"id": session["id"]}})
    assert second.model_extra["session"]["id"] == session["id"]
    assert second.usage.prompt_tokens_details.cached_tokens == session["length"]
    length2 = second.model_extra["session"]["length"]
    # Fork: a new id, the parent unchanged (two forks of it see the same history).
    forks = [api.chat.completions.create(
        model=http_server.model, messages=[{"role": "user", "content": "Fork"}], max_tokens=3,
        temperature=0, extra_body={"session": {"id": session["id"], "fork": True}})
        for _ in range(2)]
    ids = {f.model_extra["session"]["id"] for f in forks}
    assert len(ids) == 2 and session["id"] not in ids
    assert forks[0].usage.prompt_tokens_details.cached_tokens == length2
    assert forks[1].usage.prompt_tokens == forks[0].usage.prompt_tokens
    # The second fork's input is the first's: all of it cached but the last token.
    assert forks[1].usage.prompt_tokens_details.cached_tokens == forks[1].usage.prompt_tokens - 1
    # Streamed, in place: the finish chunk names the session and its new length.
    chunks = list(api.chat.completions.create(
        model=http_server.model, messages=[{"role": "user", "content": "Stream"}], max_tokens=3,
        temperature=0, stream=True, extra_body={"session": {"id": session["id"]}}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["session"]["id"] == session["id"]
    assert last.model_extra["session"]["length"] > length2
    status, body = http_server.request("DELETE", f"/v1/sessions/{session['id']}")
    assert status == 200 and body["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(
            model=http_server.model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
            extra_body={"session": {"id": session["id"]}})
    for f in forks:
        assert http_server.request("DELETE", f"/v1/sessions/{f.model_extra['session']['id']}")[0] == 200
