"""Frontend request preparation and checks (runtime/frontend/prepare.py, validate.py).

The reference for session appends is the full chat-template render of the whole
conversation, tokenized at once: what a session's history must equal token for token.
"""

from __future__ import annotations

import dataclasses

import pytest
from radixlm.runtime.frontend.prepare import TextModel, generate_ids, input_ids, pin_ids
from radixlm.runtime.frontend.session_state import EMPTY_HISTORY, SessionView, assistant_flag
from radixlm.runtime.frontend.validate import RequestError, check_generate
from radixlm.runtime.protocol import ErrorCode, Generate, Input, Message, Pin, SamplingParams
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


@pytest.mark.parametrize("ends_with_eos", [True, False], ids=["eos", "length"])
def test_session_turns_stay_token_exact_with_a_full_render(model: TextModel, ends_with_eos: bool) -> None:
    """Turn 1 opens an assistant reply; turn 2 appends a user message: the history must
    equal the full render of [system, user, assistant(reply), user] plus the header."""
    eos = next(iter(model.tokenizer.eos_token_ids))
    first = [Message(role="system", content="You are terse."), user("Hi there")]
    history = input_ids(model, Input(messages=first), EMPTY_HISTORY)
    reply = "Hello! How are you?"
    output = model.tokenizer.encode(reply) + ([eos] if ends_with_eos else [])
    history += output
    # What the engine notes once the turn ends: the flag the frontend sent with the
    # input, and the history's last token.
    assert assistant_flag(Input(messages=first)) is True
    view = SessionView(empty=False, open_assistant=True, last_token=history[-1])

    second = Input(messages=[user("Tell me more.")])
    history += input_ids(model, second, view)

    reference = full_render_ids(
        model, [*first, Message(role="assistant", content=reply), user("Tell me more.")], True)
    assert history == reference


def test_raw_text_appends_do_not_close_the_turn(model: TextModel) -> None:
    view = SessionView(empty=False, open_assistant=True, last_token=5)
    ids = input_ids(model, Input(text=" and more"), view)
    assert ids == model.tokenizer.encode(" and more")
    assert assistant_flag(Input(text=" and more")) is None  # the open turn stays open


def test_messages_without_a_template_are_refused(model: TextModel) -> None:
    bare = dataclasses.replace(model, tokenizer=_without_template(model.tokenizer))
    with pytest.raises(RequestError) as err:
        input_ids(bare, Input(messages=[user("hi")]), EMPTY_HISTORY)
    assert err.value.code == ErrorCode.NO_TEMPLATE
    assert input_ids(bare, Input(text="hi"), EMPTY_HISTORY) == model.tokenizer.encode("hi")


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
        generate(prompt_logprobs_start=-1),
    ],
    ids=["temperature", "top_p=0", "top_p>1", "max_tokens", "top_k", "empty-stop", "n=0",
         "n=65", "no-input", "two-inputs", "id-past-vocab", "negative-id", "logprob-start"],
)
def test_invalid_requests_are_refused_before_tokenizing(model: TextModel, request_: Generate) -> None:
    with pytest.raises(RequestError) as err:
        check_generate(request_, model.vocab_size)
    assert err.value.code == ErrorCode.INVALID_PARAMS and err.value.message


def test_prompt_checks(model: TextModel) -> None:
    def code(msg: Generate, history: SessionView | None = None) -> str | None:
        try:
            generate_ids(model, msg, history)
        except RequestError as e:
            return e.code
        return None

    assert code(generate(input=Input(text=""))) == ErrorCode.EMPTY_PROMPT
    assert code(generate(input=Input(input_ids=[]))) == ErrorCode.EMPTY_PROMPT
    n = len(model.tokenizer.encode("hello"))
    assert code(generate(sampling=SamplingParams(max_tokens=CONTEXT - n))) is None
    assert code(generate(sampling=SamplingParams(max_tokens=CONTEXT - n + 1))) == ErrorCode.TOO_LONG
    # A session turn's length depends on its history, which the engine checks.
    assert code(generate(input=Input(text="")), SessionView(empty=False)) is None
    assert code(generate(sampling=SamplingParams(max_tokens=CONTEXT)), SessionView(empty=False)) is None
    with pytest.raises(RequestError) as err:
        pin_ids(model, Pin(rid="p", name="x", input=Input(text="")))
    assert err.value.code == ErrorCode.EMPTY_PROMPT
