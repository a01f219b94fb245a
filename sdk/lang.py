"""The program vocabulary (SGLang's): `gen`, `select`, roles, and ``+`` to chain them.

These only *describe* what a program appends; `ProgramState` executes them. Expressions
concatenate with ``+`` (``"Q: " + rl.gen("a", stop="\\n")``), as in SGLang.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from radixlm.sdk.options import SamplingOptions, protocol_options

if TYPE_CHECKING:
    from typing_extensions import Unpack

# The program vocabulary, re-exported as `radixlm` (the classes here are the SDK's own).
__all__ = [
    "assistant",
    "assistant_begin",
    "assistant_end",
    "gen",
    "greedy_token_selection",
    "select",
    "sum_logprobs",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "user",
    "user_begin",
    "user_end",
]


class Expr:
    """Something a program can append to its state (``s += expr``)."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList((self, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), self))


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class Gen(Expr):
    """Generate into variable `name`; `sampling` holds only the options given here (the
    run's defaults fill the rest). ``n > 1`` samples n branches from one prefill."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    n: int = 1


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod


ExprLike = Union[Expr, str]


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(f"a program can append text or rl expressions (gen, select, roles), "
                    f"not {type(x).__name__}: {x!r}")


def flatten(x: Any) -> list[Expr]:
    """The primitive expressions of `x`, in order (Text, RoleBegin/End, Gen, Select)."""
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


# -- choices methods (how select() scores its options) ----------------------------------


@dataclass(frozen=True)
class ChoicesMethod:
    """How `select` turns each choice's token logprobs into a decision."""

    name: str

    def choose(self, logprobs: list[list[float]]) -> tuple[int, list[float]]:
        """(index of the chosen choice, one score per choice)."""
        if self.name == "token_length_normalized":
            scores = [sum(lp) / len(lp) if lp else -math.inf for lp in logprobs]
        elif self.name == "sum":
            scores = [sum(lp) for lp in logprobs]
        elif self.name == "greedy":
            return _greedy(logprobs)
        else:  # pragma: no cover - constructed only below
            raise ValueError(f"unknown choices method {self.name!r}")
        best = max(range(len(scores)), key=lambda i: scores[i])
        return best, scores


def _greedy(logprobs: list[list[float]]) -> tuple[int, list[float]]:
    """SGLang's greedy token selection: compare choices token by token (first token first),
    keeping the best at each position; a shorter choice is padded with its mean logprob."""
    width = max(len(lp) for lp in logprobs)
    rows = []
    for lp in logprobs:
        mean = sum(lp) / len(lp) if lp else -math.inf
        rows.append(list(lp) + [mean] * (width - len(lp)))
    remaining = list(range(len(rows)))
    for j in range(width):
        best = max(rows[i][j] for i in remaining)
        remaining = [i for i in remaining if rows[i][j] == best]
        if len(remaining) == 1:
            break
    scores = [rows[i][0] if rows[i] else -math.inf for i in range(len(rows))]
    return remaining[0], scores


token_length_normalized = ChoicesMethod("token_length_normalized")
"""Choose the choice with the highest mean token logprob (the default)."""
greedy_token_selection = ChoicesMethod("greedy")
"""SGLang's greedy token selection: compare the choices token by token."""
sum_logprobs = ChoicesMethod("sum")
"""Choose the choice with the highest total logprob (favours short choices)."""
# By the exported objects' names, as SGLang programs spell them, and by short names.
_METHODS = {
    "token_length_normalized": token_length_normalized,
    "greedy_token_selection": greedy_token_selection, "greedy": greedy_token_selection,
    "sum_logprobs": sum_logprobs, "sum": sum_logprobs,
}


def _method(method: ChoicesMethod | str | None) -> ChoicesMethod:
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    try:
        return _METHODS[method]
    except KeyError:
        raise ValueError(f"choices_method must be one of {sorted(_METHODS)}, got {method!r}") from None


# -- constructors ---------------------------------------------------------------------------



def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    *,
    n: int | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
    **sampling: Unpack[SamplingOptions],
) -> Expr:
    """Generate text into variable `name` (``s[name]``). Sampling options (those of
    `SamplingOptions`; ``max_new_tokens`` is SGLang's name for ``max_tokens``) left out
    take the run's defaults. ``n=k`` samples k branches from one prefill (``s[name]`` is
    then a list and the state continues with the first). ``choices=[...]`` is `select`.

    At most one of `regex`, `json_schema` (a JSON text, a dict, or a pydantic model
    class) and `ebnf` (a GBNF grammar with a `root` rule) constrains the output."""
    if choices is not None:
        return select(name, choices, temperature=sampling.get("temperature") or 0.0,
                      choices_method=choices_method)
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    options = protocol_options("gen()", {"max_tokens": max_tokens, **sampling})
    return Gen(name, options, n or 1)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str | None = None,
) -> Select:
    """Choose one of `choices` by the prompt logprobs of each continuation (scored in
    forked sessions, so the prompt is never recomputed). `choices_method`:
    `token_length_normalized` (default: mean token logprob), `greedy_token_selection`
    or `sum_logprobs`; `temperature` is accepted for SGLang compatibility (0 only)."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select() needs a non-empty list of strings as choices")
    if temperature not in (0, 0.0, None):
        raise ValueError("select() scores choices deterministically: temperature must be 0")
    return Select(name, tuple(choices), _method(choices_method))


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
