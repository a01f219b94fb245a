"""Frontend request preparation and checks (runtime/frontend/prepare.py, validate.py).

The reference for session appends is the full chat-template render of the whole
conversation, tokenized at once: what a session's history must equal token for token.
"""

from __future__ import annotations

import dataclasses

import pytest
from radixlm.runtime.frontend.prepare import TextModel, append_ids, assistant_flag, input_ids
from radixlm.runtime.protocol import ErrorCode, Generate, Input, Message, SamplingParams
from radixlm.runtime.rules import RequestError, check_generate
from radixlm.tokenizer import Tokenizer

CONTEXT = 256


@pytest.fixture(scope="module")
def model(tiny_tokenizer_dir: str) -> TextModel:
    tok = Tokenizer.load(tiny_tokenizer_dir)
    return TextModel(tokenizer=tok, context_length=CONTEXT, vocab_size=tok.vocab_size)


def full_render_ids(model: TextModel, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    assert model.template is not None
    return model.tokenizer.encode(model.template.render(messages, add_generation_prompt))


def user(text: str) -> Message:
    return Message(role="user", content=text)


def append(model: TextModel, inp: Input, length: int, last: int | None, open_: bool) -> list[int]:
    """What the engine appends for `inp` to a history of `length` tokens ending with
    `last` (an open assistant turn iff `open_`): the rendering it picks."""
    ids, variants = append_ids(model, inp)
    return ids if variants is None else variants.pick(ids, length, last, open_)


@pytest.mark.parametrize("ends_with_eos", [True, False], ids=["eos", "length"])
def test_session_turns_stay_token_exact_with_a_full_render(model: TextModel, ends_with_eos: bool) -> None:
    """Turn 1 opens an assistant reply; turn 2 appends a user message: the history must
    equal the full render of [system, user, assistant(reply), user] plus the header."""
    eos = next(iter(model.tokenizer.eos_token_ids))
    first = [Message(role="system", content="You are terse."), user("Hi there")]
    history = append(model, Input(messages=first), 0, None, False)  # an empty session
    assert history == full_render_ids(model, first, True)
    reply = "Hello! How are you?"
    output = model.tokenizer.encode(reply) + ([eos] if ends_with_eos else [])
    history += output
    assert assistant_flag(Input(messages=first)) is True  # the engine keeps the turn open

    second = Input(messages=[user("Tell me more.")])
    history += append(model, second, len(history), history[-1], True)

    reference = full_render_ids(
        model, [*first, Message(role="assistant", content=reply), user("Tell me more.")], True)
    assert history == reference


def test_appends_to_a_closed_history_are_the_delta(model: TextModel) -> None:
    first = [Message(role="system", content="You are terse."), user("Hi there")]
    history = append(model, Input(messages=first, add_generation_prompt=False), 0, None, False)
    second = Input(messages=[user("And again.")])
    history += append(model, second, len(history), history[-1], False)
    assert history == full_render_ids(model, [*first, user("And again.")], True)


def test_variants_travel_as_prefixes_at_special_token_seams(model: TextModel) -> None:
    """ChatML's delta starts with <|im_start|>: each variant is only its extra markup (this
    template adds nothing at the start: an empty history takes the delta as it is)."""
    ids, variants = append_ids(model, Input(messages=[user("Hi")]))
    assert variants is not None and variants.if_open is not None and variants.if_empty is None
    for v in (variants.if_open, *(variants.if_open_after or {}).values()):
        assert not v.whole and 0 < len(v.ids) < len(ids)
    assert variants.if_open_after  # <|im_end|> emitted: only the newline is left


def test_raw_text_appends_do_not_close_the_turn(model: TextModel) -> None:
    ids = append(model, Input(text=" and more"), 3, 5, True)
    assert ids == model.tokenizer.encode(" and more")
    assert assistant_flag(Input(text=" and more")) is None  # the open turn stays open


def test_messages_without_a_template_are_refused(model: TextModel) -> None:
    bare = dataclasses.replace(model, tokenizer=_without_template(model.tokenizer))
    with pytest.raises(RequestError) as err:
        input_ids(bare, Input(messages=[user("hi")]))
    assert err.value.code == ErrorCode.NO_TEMPLATE
    with pytest.raises(RequestError):
        append_ids(bare, Input(messages=[user("hi")]))
    assert input_ids(bare, Input(text="hi")) == model.tokenizer.encode("hi")


def _without_template(tok: Tokenizer) -> Tokenizer:
    return Tokenizer(tok.backend, special_tokens=tok.special_tokens, eos_token_ids=tok.eos_token_ids)


def generate(**fields: object) -> Generate:
    fields.setdefault("input", Input(text="hello"))
    return Generate(rid="r", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "request_",
    [
        generate(sampling=SamplingParams(temperature=-0.5)),
        generate(sampling=SamplingParams(top_p=0.0)),
        generate(sampling=SamplingParams(top_p=1.5)),
        generate(sampling=SamplingParams(max_tokens=-1)),
        generate(sampling=SamplingParams(top_k=-2)),
        generate(sampling=SamplingParams(stop=[""])),
        generate(n=0),
        generate(n=65),
        generate(input=Input()),
        generate(input=Input(text="a", input_ids=[1])),
        generate(input=Input(input_ids=[1, 10_000])),
        generate(input=Input(input_ids=[-1])),
        generate(n=2, sampling=SamplingParams(max_tokens=0)),
    ],
    ids=["temperature", "top_p=0", "top_p>1", "max_tokens", "top_k", "empty-stop", "n=0",
         "n=65", "no-input", "two-inputs", "id-past-vocab", "negative-id", "n2-no-output"],
)
def test_invalid_requests_are_refused_before_tokenizing(model: TextModel, request_: Generate) -> None:
    with pytest.raises(RequestError) as err:
        check_generate(request_, model.vocab_size)
    assert err.value.code == ErrorCode.INVALID_PARAMS and err.value.message
