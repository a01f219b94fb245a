"""Turning a request's `Input` into token ids: chat-template rendering and tokenization.

These functions are pure (they read the tokenizer and the request) so the frontend may run
them in worker threads. Text goes through `Tokenizer.encode_batch`, the `tokenizers` call
that releases the GIL while it runs at any length (``encode`` does only above
`GIL_FREE_ENCODE_CHARS`), so a 100k-character prompt does not stall the streams of other
requests.

Rules (docs/protocol.md states them for clients):
- ``input_ids`` are used as given.
- ``text`` is tokenized; at the start of a sequence (no session, or an empty one) with the
  tokenizer's special tokens (a BOS for Llama-style tokenizers, as ``tokenizer(text)``
  does), appended to a history without.
- ``messages`` at the start of a sequence: the full chat-template render. Appended to a
  session: only their delta markup (`ChatTemplate.render_delta`), preceded, if the
  session's last turn left an assistant reply open, by the template's end-of-turn markup
  minus the end token the model already emitted.

The frontend keeps no record of sessions: only the engine knows how a history ends. So an
append is rendered for each end it may have (`append_ids`: after a closed turn, the ids
it sends; for an empty history and an open assistant turn, the `AppendVariants`) and the
engine picks. The variants are mostly prefixes: markup that ends where the input's own
markup begins with a special token tokenizes on its own (special tokens are split off
before anything else is tokenized), so only the prefix's ids travel; the closing markups
are the same for every request and are tokenized once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from radixlm.runtime.engine.wire import AppendVariants, Variant
from radixlm.runtime.protocol import ErrorCode, Generate, Input, OpenSession, Pin, Tool
from radixlm.runtime.rules import RequestError
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

    @cached_property
    def seams(self) -> tuple[str, ...]:
        """Special tokens that text splits at: markup before one tokenizes on its own
        (``encode(a + b) == encode(a) + encode(b)`` when b starts with one). Tokens that
        strip the whitespace before them do not qualify."""
        added = self.tokenizer.backend.get_added_tokens_decoder().values()
        return tuple(t.content for t in added if t.special and not t.lstrip and t.content)

    def splits_before(self, text: str) -> bool:
        return text.startswith(self.seams) if self.seams else False

    @cached_property
    def start_affixes(self) -> tuple[list[int], list[int]] | None:
        """The special ids a sequence's start adds around its text (a BOS: ``([1], [])``),
        if ``encode(t, True) == before + encode(t) + after`` holds for sample texts; None
        when it does not (then the start is tokenized in full)."""
        found: tuple[list[int], list[int]] | None = None
        for sample in ("Hello world", " x, y\n", "1"):
            plain = _encode(self.tokenizer, sample, add_special_tokens=False)
            full = _encode(self.tokenizer, sample, add_special_tokens=True)
            at = next((i for i in range(len(full) - len(plain) + 1)
                       if full[i:i + len(plain)] == plain), None)
            if at is None:
                return None
            affixes = (full[:at], full[at + len(plain):])
            if found is not None and affixes != found:
                return None
            found = affixes
        return found

    def markup_ids(self, text: str) -> list[int]:
        """Template markup's ids, memoised: the closing markups, and the start of a
        conversation (a default system prompt), repeat in request after request. The memo
        is bounded (the ids are a cache of `encode`, never state)."""
        ids = self._markup.get(text)
        if ids is None:
            if len(self._markup) >= MARKUP_MEMO:
                self._markup.clear()
            ids = self._markup[text] = _encode(self.tokenizer, text, add_special_tokens=False)
        return ids

    @cached_property
    def closings(self) -> tuple[str, list[tuple[int, str]]] | str:
        """The markup closing an open assistant turn, and for each end-of-turn token the
        markup left once the model has emitted it (special tokens kept in its text:
        ``<|im_end|>``); the template's message if it cannot close a turn."""
        template = self.template
        assert template is not None
        tokenizer = self.tokenizer
        try:
            return template.assistant_end(), [
                (t, template.assistant_end(tokenizer.decode([t])))
                for t in sorted(tokenizer.eos_token_ids)]
        except ChatTemplateError as e:
            return f"chat template: {e}"

    _markup: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)


MARKUP_MEMO = 256  # distinct markups memoised by `TextModel.markup_ids`


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


def input_ids(model: TextModel, inp: Input, start: bool = True,
              tools: Sequence[Tool] | None = None) -> list[int]:
    """The tokens `inp` adds: at the `start` of a sequence, or after a closed history;
    `tools` are rendered with `messages` (by the template, or as radixlm's generic tool
    prompt when the sequence starts here and the template has no tool support)."""
    if inp.input_ids is not None:
        return list(inp.input_ids)
    tokenizer = model.tokenizer
    if inp.text is not None:
        return _encode(tokenizer, inp.text, add_special_tokens=start)
    text = _render(model, inp, start, tools)
    return _encode(tokenizer, text, add_special_tokens=False)


def append_ids(model: TextModel, inp: Input, tools: Sequence[Tool] | None = None
               ) -> tuple[list[int], AppendVariants | None]:
    """An input appended to a session: its ids after a closed turn, and its renderings for
    an empty history and an open assistant turn (None: an input kind that needs none)."""
    tokenizer = model.tokenizer
    if inp.input_ids is not None:
        return list(inp.input_ids), None
    if inp.text is not None:
        ids = _encode(tokenizer, inp.text, add_special_tokens=False)
        return ids, AppendVariants(if_empty=_text_start(model, inp.text, ids))
    variants = AppendVariants()
    try:
        body: str | None = _render(model, inp, False, tools)
    except RequestError as e:
        if e.code == ErrorCode.NO_TEMPLATE:
            raise
        body = None  # no append is possible: only a start may be (the engine decides)
        variants.closed_error = variants.open_error = e.message
    try:
        full = _render(model, inp, True, tools)
        variants.if_empty = (_variant_for(model, full, body) if body is not None else
                             Variant(ids=_encode(tokenizer, full, add_special_tokens=False),
                                     whole=True))
    except RequestError as e:  # the engine refuses the turn if the history is empty
        variants.empty_error = e.message
    if body is None:
        return [], variants
    closings = model.closings
    if isinstance(closings, str):
        variants.open_error = closings
    else:
        close, after = closings
        variants.if_open = _prefixed(model, close, body)
        for token, markup in after:
            if markup != close:
                variants.if_open_after = variants.if_open_after or {}
                variants.if_open_after[token] = _prefixed(model, markup, body)
    return _encode(tokenizer, body, add_special_tokens=False), variants


def _render(model: TextModel, inp: Input, start: bool, tools: Sequence[Tool] | None) -> str:
    """The markup of `inp.messages`: a full render at the start of a sequence, else the
    delta that follows a closed history."""
    assert inp.messages is not None  # check_input ran on the main thread
    template = model.template
    if template is None:
        raise RequestError(
            ErrorCode.NO_TEMPLATE, "this model has no chat template: send text or input_ids"
        )
    fmt = model.tool_format
    messages = template_messages(inp.messages, fmt, tools, with_tools_prompt=start)
    rendered_tools = tool_dicts(tools) if tools and fmt != "generic" else None
    try:
        if start:
            return template.render(messages, inp.add_generation_prompt, tools=rendered_tools)
        return template.render_delta(messages, inp.add_generation_prompt, tools=rendered_tools)
    except ChatTemplateError as e:
        raise RequestError(ErrorCode.INVALID_PARAMS, f"chat template: {e}") from None


def _text_start(model: TextModel, text: str, ids: list[int]) -> Variant | None:
    """Text at the start of a sequence: with the tokenizer's special tokens."""
    affixes = model.start_affixes
    if affixes is None:
        return Variant(ids=_encode(model.tokenizer, text, add_special_tokens=True), whole=True)
    before, after = affixes
    if after:
        return Variant(ids=before + ids + after, whole=True)
    return Variant(ids=before) if before else None


def _variant_for(model: TextModel, full: str, body: str) -> Variant | None:
    """`full` (another rendering of the input) as a variant of `body`'s ids."""
    if full == body:
        return None
    if body and full.endswith(body):
        return _prefixed(model, full[: len(full) - len(body)], body)
    return Variant(ids=_encode(model.tokenizer, full, add_special_tokens=False), whole=True)


def _prefixed(model: TextModel, prefix: str, body: str) -> Variant:
    """`prefix` + `body`: only the prefix's ids where the body starts at a seam."""
    if model.splits_before(body):
        return Variant(ids=model.markup_ids(prefix))
    return Variant(ids=_encode(model.tokenizer, prefix + body, add_special_tokens=False),
                   whole=True)


def _encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def assistant_flag(inp: Input | None) -> bool | None:
    """Whether a history ends inside an assistant turn once `inp` is appended to it:
    messages end with the assistant header iff ``add_generation_prompt``; raw text or ids
    change nothing (None: they extend whatever turn is open)."""
    if inp is not None and inp.messages is not None:
        return inp.add_generation_prompt
    return None


def generate_ids(model: TextModel, msg: Generate) -> tuple[list[int], AppendVariants | None]:
    """The ids an `EngineGenerate` carries: the whole prompt, or the append to a session
    with its variants."""
    if msg.session is not None:
        return append_ids(model, msg.input, msg.tools)
    return input_ids(model, msg.input, True, msg.tools), None


def open_session_ids(model: TextModel, msg: OpenSession) -> list[int]:
    """The ids a new session starts with (after the pin's tokens, if from a pin)."""
    if msg.input is None:
        return []
    return input_ids(model, msg.input, start=msg.pinned is None)


def pin_ids(model: TextModel, msg: Pin) -> list[int]:
    return input_ids(model, msg.input)
