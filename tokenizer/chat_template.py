"""`ChatTemplate`: HF chat templates rendered with jinja2, in full or as a delta.

Rendering follows `transformers`' ``apply_chat_template(..., tokenize=False)`` exactly: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, loop controls,
the ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a ``tojson`` that does
not HTML-escape, ``dict`` and an underscore-proof ``namespace``; messages are converted to
plain data with ``None`` fields dropped; the template sees ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens (``bos_token``,
``eos_token``, ...) and any extra keyword (``enable_thinking=False`` ...).

Sessions never re-render their history: `ChatTemplate.render_delta` renders only the
markup that appending messages adds. It is computed by rendering a placeholder history
``H`` with and without the new messages and taking the difference:

- prefix rule: if ``render(H)`` is a prefix of ``render(H + new)``, the delta is the rest;
- anchor rule: some templates re-render earlier turns once a later one exists (Qwen3
  drops the ``<think>`` block of assistant turns before the last user query). Then the
  delta is what follows the last history message's content *and its closing markup*
  (both taken from ``render(H)``) in ``render(H + new)``.

Placeholder histories are tried in order (with and without a system message, ending in a
user or assistant turn as the first new message needs, so templates that enforce role
alternation or reject system messages still render); the first that renders wins.
Templates that inject a default system prompt when none is given (SmolLM2, Qwen2) put it
in the history's part, so a delta never re-adds it. With ``has_history=False`` the delta
is the full render (default system prompt and BOS included).

Token boundary: ``encode(render(H)) + encode(delta) == encode(render(H + new))`` holds
whenever the delta starts with a special token (ChatML ``<|im_start|>``, Llama-3
``<|start_header_id|>``): added tokens split the text before the BPE runs, so nothing
merges across the boundary. Templates whose turns start with plain text (``[INST]``,
``User:``) can tokenize differently at the seam; sessions keep the tokens they appended,
which are a valid (if not canonical) tokenization of the same text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """A template could not render the requested messages (or their delta)."""


# -- the jinja environment (transformers' conventions) --------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (HF uses it for masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` in templates, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `self` in args
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
            )


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# -- plain data -------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """What a template may see: JSON-like data rebuilt from dicts, lists, dataclasses,
    msgspec structs and pydantic models (as transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    fields = getattr(type(value), "__struct_fields__", None)  # msgspec.Struct
    if isinstance(fields, tuple):
        return {name: _plain(getattr(value, name)) for name in fields}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _plain(value.item())
        except (TypeError, ValueError):
            pass
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Plain dicts with ``None`` values dropped and reasoning aliased, as transformers does."""
    out = []
    for message in messages:
        m = _plain(message)
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be mappings or structs, got {message!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# -- placeholder histories for deltas -------------------------------------------------

_ANCHOR = "\u2063radixlm-anchor-{}\u2063"  # invisible separators: never produced by templates


def _msg(role: str, n: int, **extra: Any) -> dict:
    return {"role": role, "content": _ANCHOR.format(n), **extra}


_TOOL_CALL = {"type": "function", "id": "call_0", "function": {"name": "f", "arguments": {}}}


def _placeholder_histories(first_role: str) -> list[list[dict]]:
    """Histories a message of `first_role` can follow, most natural first."""
    sys_, user, asst = _msg("system", 0), _msg("user", 1), _msg("assistant", 2)
    if first_role == "assistant":
        return [[sys_, user], [user]]
    if first_role == "tool":
        asst_tc = _msg("assistant", 2, tool_calls=[_TOOL_CALL])
        return [[sys_, user, asst_tc], [user, asst_tc], [sys_, user, asst], [user, asst]]
    return [[sys_, user, asst], [user, asst], [sys_], []]


_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class ChatTemplate:
    """A compiled HF chat template.

    `render` equals transformers' ``apply_chat_template(messages, tokenize=False, ...)``;
    `render_delta` renders only what appending messages adds (see the module docstring);
    `generation_prompt` is the assistant header alone and `assistant_end` the markup that
    closes an assistant turn.
    """

    def __init__(
        self,
        template_str: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        *,
        extra_context: Mapping[str, Any] | None = None,
    ) -> None:
        self.source = template_str
        self.bos_token = bos_token
        self.eos_token = eos_token
        context: dict[str, Any] = dict(extra_context or {})
        if bos_token is not None:
            context["bos_token"] = bos_token
        if eos_token is not None:
            context["eos_token"] = eos_token
        self._context = context
        try:
            self._template = _compile(template_str)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self._cache: dict[tuple, str] = {}
        self._hints: dict[str, int] = {}  # first new role -> placeholder history that works

    # -- full render ------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool = False,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The template applied to `messages` (dicts, msgspec structs or dataclasses with
        ``role``/``content``...). `tools` are JSON-schema dicts (transformers also turns
        Python functions into schemas; radixlm does not). `kwargs` become template
        variables (they override the special tokens, as in transformers)."""
        return self._render(_normalize_messages(messages), add_generation_prompt, tools, kwargs)

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: Sequence[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        variables = {**self._context, **_plain(dict(kwargs))}
        documents = variables.pop("documents", None)
        return self._template.render(
            messages=messages,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # -- deltas ---------------------------------------------------------------------------

    def render_delta(
        self,
        new_messages: Sequence[Any],
        add_generation_prompt: bool = False,
        has_history: bool = True,
        *,
        history: Sequence[Any] | None = None,
        tools: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """The markup appending `new_messages` (then, if asked, the assistant header) adds
        to a conversation.

        ``render(h) + render_delta(new, g, history=h) == render(h + new, g)`` whenever the
        template renders `h` as a prefix of ``h + new`` (otherwise the anchor rule of the
        module docstring applies). Without `history`, placeholder histories are used (the
        delta of ordinary chat templates does not depend on the history's content); with
        ``has_history=False`` (and no `history`) the result is the full render of
        `new_messages`. Raises `ChatTemplateError` if the template cannot render the new
        messages as an append (e.g. it merges them into the history's last turn).
        """
        new = _normalize_messages(new_messages)
        hist = _normalize_messages(history) if history is not None else None
        if hist == [] or (hist is None and not has_history):
            return self._render(new, add_generation_prompt, tools, kwargs)
        if not new and not add_generation_prompt:
            return ""

        first_role = str(new[0].get("role", "user")) if new else "assistant"
        if hist is not None:
            candidates = [hist]
        else:
            candidates = _placeholder_histories(first_role)
            # Try the placeholder that worked last time for this role first.
            hint = self._hints.get(first_role, 0)
            candidates.insert(0, candidates.pop(hint))
        errors: list[str] = []
        for candidate in candidates:
            try:
                delta = self._delta(candidate, new, add_generation_prompt, tools, kwargs)
            except _RENDER_ERRORS as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if delta is not None:
                if hist is None:
                    self._hints[first_role] = _placeholder_histories(first_role).index(candidate)
                return delta
            errors.append(
                f"a history of roles {[m.get('role') for m in candidate]} is rendered "
                "differently once the new messages follow it"
            )
        raise ChatTemplateError(
            "the chat template cannot render these messages as an append to a history "
            f"(roles {[m.get('role') for m in new]}): " + "; ".join(errors)
        )

    def _delta(
        self,
        hist: list[dict],
        new: list[dict],
        add_generation_prompt: bool,
        tools: Sequence[Any] | None,
        kwargs: Mapping[str, Any],
    ) -> str | None:
        base = self._render(hist, False, tools, kwargs)
        full = self._render(hist + new, add_generation_prompt, tools, kwargs)
        if full.startswith(base):
            return full[len(base) :]
        if not hist:
            return None
        # Anchor rule: the last history message's content and closing markup reappear.
        anchor = hist[-1].get("content")
        if not isinstance(anchor, str) or base.count(anchor) != 1 or full.count(anchor) != 1:
            return None
        tail = base[base.index(anchor) + len(anchor) :]
        start = full.index(anchor) + len(anchor)
        if not full.startswith(tail, start):
            return None
        return full[start + len(tail) :]

    def generation_prompt(self, **kwargs: Any) -> str:
        """The assistant header that ``add_generation_prompt=True`` appends after a user turn
        (``"<|im_start|>assistant\\n"`` for ChatML)."""
        key = ("generation_prompt", *sorted(kwargs.items()))
        cached = self._cache.get(key) if _hashable(key) else None
        if cached is None:
            cached = self.render_delta([], add_generation_prompt=True, **kwargs)
            if _hashable(key):
                self._cache[key] = cached
        return cached

    def assistant_end(self, emitted: str = "", **kwargs: Any) -> str:
        """The markup that closes an assistant turn before the next message
        (``"<|im_end|>\\n"`` for ChatML, ``"<|eot_id|>"`` for Llama 3).

        `emitted`: what the model already produced of it (typically its end-of-turn token,
        decoded); if the markup starts with it, only the remainder is returned.
        """
        key = ("assistant_end", *sorted(kwargs.items()))
        end = self._cache.get(key) if _hashable(key) else None
        if end is None:
            end = self._assistant_end(kwargs)
            if _hashable(key):
                self._cache[key] = end
        if emitted and end.startswith(emitted):
            return end[len(emitted) :]
        return end

    def _assistant_end(self, kwargs: Mapping[str, Any]) -> str:
        reply = _msg("assistant", 3)
        anchor = reply["content"]
        follow = _msg("user", 4)
        errors: list[str] = []
        for prefix in ([_msg("system", 0), _msg("user", 1)], [_msg("user", 1)]):
            hist = [*prefix, reply]
            try:
                full = self._render([*hist, follow], False, None, kwargs)
                follow_delta = self.render_delta([follow], history=hist, **kwargs)
            except (ChatTemplateError, *_RENDER_ERRORS) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if full.count(anchor) != 1:
                continue
            after = full[full.index(anchor) + len(anchor) :]
            if after.endswith(follow_delta):
                return after[: len(after) - len(follow_delta)]
            errors.append("the next turn's markup does not follow the reply")
        raise ChatTemplateError(
            "cannot find the template's assistant end-of-turn markup: " + "; ".join(errors)
        )

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, bos={self.bos_token!r}, eos={self.eos_token!r})"


def _hashable(key: tuple) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True
