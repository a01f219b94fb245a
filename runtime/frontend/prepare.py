"""Turning a request's `Input` into token ids: chat-template rendering and tokenization.

These functions are pure (they read the tokenizer and an immutable `SessionView`) so the
frontend may run them in worker threads. Text goes through `Tokenizer.encode_batch`, the
`tokenizers` call that releases the GIL while it runs at any length (``encode`` does only
above `GIL_FREE_ENCODE_CHARS`), so a 100k-character prompt does not stall the streams of
other requests.

Rules (docs/protocol.md states them for clients):
- ``input_ids`` are used as given.
- ``text`` is tokenized; at the start of a sequence (no session, or an empty one) with the
  tokenizer's special tokens (a BOS for Llama-style tokenizers, as ``tokenizer(text)``
  does), appended to a history without.
- ``messages`` at the start of a sequence: the full chat-template render. Appended to a
  session: only their delta markup (`ChatTemplate.render_delta`), preceded, if the
  session's last turn left an assistant reply open, by the template's end-of-turn markup
  minus the end token the model already emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from radixlm.runtime.frontend.session_state import EMPTY_HISTORY, SessionView
from radixlm.runtime.frontend.validate import RequestError, check_prompt_length
from radixlm.runtime.protocol import ErrorCode, Generate, Input, OpenSession, Pin, Tool
from radixlm.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer
from radixlm.tokenizer.tools import ToolFormat, template_messages, tool_dicts, tool_format


@dataclass(frozen=True, eq=False)
class TextModel:
    """The model's text side, as the frontend sees it."""

    tokenizer: Tokenizer
    context_length: int
    vocab_size: int  # input ids must be below this (the model's embedding rows)
    # Text longer than this (UTF-8 bytes) cannot fit the context: refused before tokenizing.
    max_input_bytes: int = 0  # 0 = no check

    @classmethod
    def load(cls, tokenizer: Tokenizer, context_length: int, vocab_size: int) -> TextModel:
        return cls(tokenizer, context_length, vocab_size,
                   max_input_bytes=context_length * max_token_bytes(tokenizer) * BYTES_MARGIN)

    @property
    def template(self) -> ChatTemplate | None:
        return self.tokenizer.chat_template

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How this model is shown tools and writes calls (`radixlm.tokenizer.tools`)."""
        template = self.template
        return tool_format(template.source if template is not None else None)


# Slack on top of "context x longest token": normalizers that drop characters are rare in
# this model family, but the check must never refuse a text that would have fit.
BYTES_MARGIN = 2


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes of input text one token can stand for: the longest token of
    the vocabulary (special tokens included: text may spell them), at least 4 (one
    character; a byte-fallback token of a partial character decodes to 3 bytes)."""
    backend = tokenizer.backend
    n = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    return max(4, max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=0))


def input_ids(model: TextModel, inp: Input, history: SessionView,
              tools: Sequence[Tool] | None = None) -> list[int]:
    """The tokens `inp` adds to a history (`EMPTY_HISTORY` for a fresh prompt); `tools`
    are rendered with `messages` (by the template, or as radixlm's generic tool prompt
    when the sequence starts here and the template has no tool support)."""
    if inp.input_ids is not None:
        return list(inp.input_ids)
    tokenizer = model.tokenizer
    if inp.text is not None:
        return _encode(tokenizer, inp.text, add_special_tokens=history.empty)
    assert inp.messages is not None  # check_input ran on the main thread
    template = model.template
    if template is None:
        raise RequestError(
            ErrorCode.NO_TEMPLATE, "this model has no chat template: send text or input_ids"
        )
    fmt = model.tool_format
    messages = template_messages(inp.messages, fmt, tools, with_tools_prompt=history.empty)
    rendered_tools = tool_dicts(tools) if tools and fmt != "generic" else None
    try:
        if history.empty:
            text = template.render(messages, inp.add_generation_prompt, tools=rendered_tools)
        else:
            text = template.render_delta(messages, inp.add_generation_prompt,
                                         tools=rendered_tools)
            if history.open_assistant:
                text = _close_assistant_turn(tokenizer, template, history) + text
    except ChatTemplateError as e:
        raise RequestError(ErrorCode.INVALID_PARAMS, f"chat template: {e}") from None
    return _encode(tokenizer, text, add_special_tokens=False)


def _encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def _close_assistant_turn(tokenizer: Tokenizer, template: ChatTemplate, history: SessionView) -> str:
    last = history.last_token
    emitted = ""
    if last is not None and last in tokenizer.eos_token_ids:
        emitted = tokenizer.decode([last])  # special tokens kept: "<|im_end|>"
    return template.assistant_end(emitted)


def generate_ids(model: TextModel, msg: Generate, history: SessionView | None) -> list[int]:
    """The ids an `EngineGenerate` carries: the whole prompt, or the append to a session."""
    ids = input_ids(model, msg.input, history if history is not None else EMPTY_HISTORY,
                    msg.tools)
    check_prompt_length(
        len(ids), msg.sampling, model.context_length, in_session=history is not None,
        prompt_logprobs_start=msg.prompt_logprobs_start,
    )
    return ids


def open_session_ids(model: TextModel, msg: OpenSession, pin_history: SessionView) -> list[int]:
    """The ids a new session starts with (after the pin's tokens, if from a pin)."""
    if msg.input is None:
        return []
    ids = input_ids(model, msg.input, pin_history)
    _check_fits(model, len(ids))
    return ids


def pin_ids(model: TextModel, msg: Pin) -> list[int]:
    ids = input_ids(model, msg.input, EMPTY_HISTORY)
    if not ids:
        raise RequestError(ErrorCode.EMPTY_PROMPT, f"pin {msg.name!r} has an empty input")
    _check_fits(model, len(ids))
    return ids


def _check_fits(model: TextModel, n: int) -> None:
    if n > model.context_length:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"input ({n} tokens) exceeds the context length ({model.context_length})",
        )
