"""The program vocabulary (SGLang's): `gen`, `select`, roles, and ``+`` to chain them.

These only *describe* what a program appends; `ProgramState` executes them. Expressions
concatenate with ``+`` (``"Q: " + rl.gen("a", stop="\\n")``), as in SGLang.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from radixlm.sdk.choices import choices_method as choices_method_of
from radixlm.sdk.choices import (
    greedy_token_selection,
    sum_logprobs,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.sdk.dtypes import dtype_constraint
from radixlm.sdk.options import SamplingOptions, protocol_options
from radixlm.sdk.reasoning import ReasoningFormat, reasoning_format, reasoning_name

if TYPE_CHECKING:
    from typing_extensions import Unpack

# The program vocabulary, re-exported as `radixlm` (the classes here are the SDK's own).
__all__ = [  # (`RoleScopes` is the states' base, not a program word)
    "assistant",
    "assistant_begin",
    "assistant_end",
    "gen",
    "gen_int",
    "gen_string",
    "greedy_token_selection",
    "select",
    "separate_reasoning",
    "sum_logprobs",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]

GREEDY_SELECT = 1e-5  # SGLang's select asserts temperature <= this


class Expr:
    """Something a program can append to its state (``s += expr``). Expressions are
    plain slotted records, made afresh on every ``gen()`` and ``+`` (nothing changes one
    after it is made; frozen dataclasses cost several times more to build)."""

    __slots__ = ()

    def __add__(self, other: Any) -> ExprList:
        return ExprList((self, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), self))


@dataclass(slots=True)
class Text(Expr):
    value: str


@dataclass(slots=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(slots=True)
class Gen(Expr):
    """Generate into variable `name`; `sampling` holds only the `SamplingParams` options
    given here, and the other fields only what was given (the run's defaults fill the
    rest). `dtype_stop`: stop strings a ``dtype`` adds to whatever stops apply."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int | None = None  # branches from one prefill
    logprob_start_len: int | None = None  # prompt logprobs from this token of the text
    text_in_logprobs: bool | None = None
    dtype_stop: tuple[str, ...] = ()


@dataclass(slots=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: Any  # a choices method (`radixlm.sdk.choices`)


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class SeparateReasoning(Expr):
    """Split the reasoning out of the variables `names` (set by the expression before)."""

    format: ReasoningFormat
    names: tuple[str | None, ...]


ExprLike = Union[Expr, str]


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(f"a program can append text or rl expressions (gen, select, roles), "
                    f"not {type(x).__name__}: {x!r}")


def flatten(x: Any) -> list[Expr]:
    """The primitive expressions of `x`, in order (Text, RoleBegin/End, Gen, Select,
    VarScopeBegin/End, SeparateReasoning)."""
    if type(x) is str:
        return [Text(x)]
    if not isinstance(x, ExprList):
        return [as_expr(x)]
    out: list[Expr] = []
    _flatten_into(x.items, out)
    return out


def _flatten_into(items: tuple[Any, ...], out: list[Expr]) -> None:
    for item in items:
        if isinstance(item, ExprList):
            _flatten_into(item.items, out)
        else:  # `+` and the role helpers made the items Exprs already, mostly
            out.append(item if isinstance(item, Expr) else as_expr(item))


# -- constructors ---------------------------------------------------------------------------


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: Any = None,
    regex: str | None = None,
    json_schema: Any = None,
    **sampling: Unpack[SamplingOptions],
) -> Expr:
    """Generate text into variable `name` (``s[name]``), with SGLang's parameters in
    SGLang's order; any argument left out (or None) takes the run's default. Beyond
    SGLang's: the other `SamplingOptions` (``seed``, ``repetition_penalty``, ``ebnf``...).

    - ``n=k``: k branches from one prefill (``s[name]`` is then a list; the state
      continues with the first).
    - ``min_tokens``: EOS and ``stop_token_ids`` cannot end the output before this many
      tokens (stop strings still can), as SGLang's ``min_new_tokens``.
    - ``stop_regex``: a regex (or several) that ends the output once the text matches it
      (the matched text stays in the output, as in SGLang).
    - ``return_logprob``/``top_logprobs_num``: the output's logprobs in the meta info;
      with ``logprob_start_len=k`` also the prompt's from token k of the state's whole
      text (``input_token_logprobs``); ``return_text_in_logprobs`` fills in each token's
      text in those ``(logprob, token_id, text)`` triples.
    - ``dtype=int|float|str|bool``: the output is constrained to a literal of that type
      (a regex, plus stops " " and "\\n" for numbers; see `radixlm.sdk.dtypes`).
    - ``choices=[...]``: `select`. At most one of `regex`, `json_schema` (JSON text, a
      dict, or a pydantic model class) and `ebnf` constrains the output.
    """
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method)
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"gen(regex=...) is not a valid regex: {e}") from None
    # Only what was given (the run's defaults fill the rest), tested one by one: gen() is
    # the SDK's hottest call, and this is several times cheaper than a loop over them.
    given: dict[str, Any] = dict(sampling)
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    if min_tokens is not None:
        given["min_tokens"] = min_tokens
    if stop is not None:
        given["stop"] = stop
    if stop_token_ids is not None:
        given["stop_token_ids"] = stop_token_ids
    if stop_regex is not None:
        given["stop_regex"] = stop_regex
    if temperature is not None:
        given["temperature"] = temperature
    if top_p is not None:
        given["top_p"] = top_p
    if top_k is not None:
        given["top_k"] = top_k
    if min_p is not None:
        given["min_p"] = min_p
    if frequency_penalty is not None:
        given["frequency_penalty"] = frequency_penalty
    if presence_penalty is not None:
        given["presence_penalty"] = presence_penalty
    if ignore_eos is not None:
        given["ignore_eos"] = ignore_eos
    if return_logprob is not None:
        given["return_logprob"] = return_logprob
    if top_logprobs_num is not None:
        given["top_logprobs_num"] = top_logprobs_num
    if regex is not None:
        given["regex"] = regex
    if json_schema is not None:
        given["json_schema"] = json_schema
    options = protocol_options("gen()", given)
    dtype_stop: tuple[str, ...] = ()
    if dtype is not None:
        constraint = dtype_constraint(dtype, options.get("regex"))
        options["regex"] = constraint.regex
        dtype_stop = constraint.stop
    if logprob_start_len is not None and logprob_start_len < 0:
        raise ValueError(f"logprob_start_len must be >= 0, got {logprob_start_len}")
    return Gen(name, options, n, logprob_start_len, return_text_in_logprobs, dtype_stop)


# gen()'s parameters that the typed gens (SGLang's gen_int, gen_string) do not take.
_NOT_TYPED = frozenset({"min_tokens", "dtype", "choices", "choices_method", "regex",
                        "json_schema", "sampling"})


def _typed_gen(dtype: type, name: str, doc: str) -> Callable[..., Expr]:
    """SGLang's typed gen: gen()'s parameters but those in `_NOT_TYPED`, in its order."""
    signature = inspect.signature(gen)
    signature = signature.replace(parameters=[
        p for p in signature.parameters.values() if p.name not in _NOT_TYPED])

    def typed(*args: Any, **kwargs: Any) -> Expr:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{name}(): {e}") from None
        return gen(**bound.arguments, dtype=dtype)

    typed.__name__ = typed.__qualname__ = name
    typed.__doc__ = doc
    typed.__signature__ = signature  # type: ignore[attr-defined]  # what help() shows
    return typed


gen_int = _typed_gen(int, "gen_int", "``gen(..., dtype=int)``: an integer literal (SGLang's "
                                    "``gen_int``).")
gen_string = _typed_gen(str, "gen_string", "``gen(..., dtype=str)``: a double-quoted string of "
                                           "word characters and spaces (SGLang's ``gen_string``).")


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: Any = None,
) -> Select:
    """Choose one of `choices` by the logprobs of each continuation (scored in forked
    sessions, so the prompt is never recomputed). `choices_method`: `token_length_normalized`
    (default: mean token logprob), `greedy_token_selection`,
    `unconditional_likelihood_normalized`, `sum_logprobs`, their names, or a
    `ChoicesSamplingMethod` of your own. `temperature`: SGLang scores at 0 only."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select() needs a non-empty list of strings as choices")
    if temperature not in (0, 0.0, None) and temperature > GREEDY_SELECT:
        raise ValueError("select() scores choices deterministically: temperature must be 0")
    return Select(name, tuple(choices), choices_method_of(choices_method))


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ExprList:
    """`expr` (a gen or select, or an expression holding some) with each one's reasoning
    moved out: ``s[name]`` keeps the answer and ``s[name + "_reasoning_content"]`` gets
    the thinking block (see `radixlm.sdk.reasoning` for the model types). Not applied to
    a run with ``stream=True`` (as in SGLang)."""
    fmt = reasoning_format(model_type)
    names = tuple(_generated_names(flatten(expr))) if expr is not None else ()
    for var in names:
        reasoning_name(var)  # a name is needed: the error now, not at run time
    parts: tuple[Expr, ...] = (as_expr(expr),) if expr is not None else ()
    return ExprList((*parts, SeparateReasoning(fmt, names)))


def _generated_names(items: list[Expr]) -> list[str | None]:
    return [x.name for x in items if isinstance(x, (Gen, Select))]


class RoleScopes:
    """SGLang's state methods that append roles and variable scopes, shared by the
    program state and the traced one: ``s.user(expr)`` appends the role expression (and
    returns it), ``with s.user():`` makes what is appended inside one message, and
    ``with s.var_scope(name):`` makes the text appended inside a variable. A subclass
    says how its state takes expressions (`_append`)."""

    __slots__ = ()

    def _append(self, items: list[Expr]) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._scope(_BEGIN[role], _END[role])
        whole = ExprList((_BEGIN[role], as_expr(expr), _END[role]))
        self._append(flatten(whole))
        return whole

    @contextmanager
    def _scope(self, begin: Expr, end: Expr) -> Iterator[None]:
        self._append([begin])
        yield
        self._append([end])

    def system(self, expr: Any = None) -> Any:
        """``s.system(expr)`` appends a system message (as ``s += rl.system(expr)``);
        ``with s.system():`` makes what is appended inside it one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        """``s.user(expr)``, or ``with s.user(): ...``: a user message (see `system`)."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """``s.assistant(expr)``, or ``with s.assistant(): ...``: an assistant message
        (see `system`); generate inside it."""
        return self._role("assistant", expr)

    def var_scope(self, name: str) -> AbstractContextManager[None]:
        """``with s.var_scope("x"): ...``: the text appended inside (generated or not)
        becomes variable ``x``."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))


# Role markers are immutable: one of each, shared.
_BEGIN = {role: RoleBegin(role) for role in ("system", "user", "assistant")}
_END = {role: RoleEnd(role) for role in ("system", "user", "assistant")}


def _role_functions(
    role: str,
) -> tuple[Callable[[Any], ExprList], Callable[[], RoleBegin], Callable[[], RoleEnd]]:
    """`role(expr)`, `role_begin()` and `role_end()` for one chat role."""

    def whole(expr: Any = None) -> ExprList:
        if expr is None:
            return ExprList((_BEGIN[role], _END[role]))
        return ExprList((_BEGIN[role], as_expr(expr), _END[role]))

    def begin() -> RoleBegin:
        return _BEGIN[role]

    def end() -> RoleEnd:
        return _END[role]

    made = ((whole, role, f"A whole {role} message: ``rl.{role}(text + rl.gen(...))``."),
            (begin, f"{role}_begin", f"Start a {role} message (end it with ``{role}_end()``)."),
            (end, f"{role}_end", f"End the {role} message ``{role}_begin()`` started."))
    for fn, name, doc in made:
        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = doc
    return whole, begin, end


system, system_begin, system_end = _role_functions("system")
user, user_begin, user_end = _role_functions("user")
assistant, assistant_begin, assistant_end = _role_functions("assistant")
