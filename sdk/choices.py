"""How `select` decides among its choices: SGLang's choices sampling methods.

A method is called once per select with the scores of every choice, by keyword (SGLang's
interface, so a program's own `ChoicesSamplingMethod` subclass works too):

- ``choices``: the choice strings;
- ``normalized_prompt_logprobs``: each choice's mean token logprob;
- ``input_token_logprobs``: each choice's tokens as ``(logprob, token_id, text)`` triples
  (the choice's own tokens, scored after the state's text);
- ``output_token_logprobs``: each choice's output logprobs (``[]``: nothing is generated);
- ``unconditional_token_logprobs``: each choice's tokens scored alone (the first ``None``),
  only for methods whose ``requires_unconditional_logprobs`` is true.

It returns a `ChoicesDecision`: the chosen string and a ``meta_info`` dict, which becomes
the select's meta info (with the SDK's usage keys added).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "GreedyTokenSelection",
    "SumLogprobs",
    "TokenLengthNormalized",
    "UnconditionalLikelihoodNormalized",
    "choices_method",
    "decide",
    "greedy_token_selection",
    "sum_logprobs",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
]

Triples = list[list[Any]]  # per choice: (logprob, token_id, text) per token


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _values(triples: list[Any]) -> list[float]:
    """The logprobs of one choice's triples (a missing one, None, is left out)."""
    return [t[0] for t in triples if t[0] is not None]


def mean_logprob(triples: list[Any]) -> float:
    """A choice's mean token logprob (-inf for a choice without scored tokens)."""
    values = _values(triples)
    return sum(values) / len(values) if values else -math.inf


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: scores[i])  # the first of equal bests


class ChoicesSamplingMethod(ABC):
    """Base of the choices methods (subclass it, as in SGLang, for a method of your own)."""

    name = "custom"

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the method needs each choice's logprobs without context (an extra
        request per choice)."""
        return False

    @abstractmethod
    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: Triples, output_token_logprobs: Triples,
                 unconditional_token_logprobs: Triples | None = None) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return f"<choices method {self.name}>"


def _meta(normalized: list[float], inputs: Triples, outputs: Triples, **extra: Any) -> dict[str, Any]:
    return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
            "output_token_logprobs": outputs, **extra}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    name = "token_length_normalized"

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: Triples, output_token_logprobs: Triples,
                 unconditional_token_logprobs: Triples | None = None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            scores=list(normalized_prompt_logprobs)))


class SumLogprobs(ChoicesSamplingMethod):
    """The choice with the highest total logprob (radixlm's; it favours short choices)."""

    name = "sum"

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: Triples, output_token_logprobs: Triples,
                 unconditional_token_logprobs: Triples | None = None) -> ChoicesDecision:
        totals = [sum(_values(t)) for t in input_token_logprobs]
        return ChoicesDecision(choices[_argmax(totals)], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            scores=totals))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare the choices token by token, first token first, keeping those with the best
    logprob at each position until one is left; a shorter choice is padded with its own
    mean logprob (so a choice that is a prefix of a longer one competes fairly)."""

    name = "greedy"

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: Triples, output_token_logprobs: Triples,
                 unconditional_token_logprobs: Triples | None = None) -> ChoicesDecision:
        rows = [_values(t) for t in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [sum(r) / len(r) if r else -math.inf] * (width - len(r)) for r in rows]
        remaining = list(range(len(matrix)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(choices[remaining[0]], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            greedy_logprob_matrix=matrix,
            scores=[r[0] if r else -math.inf for r in matrix]))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most, on average, from the state's text: the mean
    of (logprob after the text - logprob of the choice alone). A missing unconditional
    logprob (the choice's first token has no context) counts as 0."""

    name = "unconditional_likelihood_normalized"

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Yes: it compares each choice's logprobs with and without the context."""
        return True

    def __call__(self, *, choices: list[str], normalized_prompt_logprobs: list[float],
                 input_token_logprobs: Triples, output_token_logprobs: Triples,
                 unconditional_token_logprobs: Triples | None = None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional "
                             "token logprobs of every choice")
        normalized = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            diffs = [c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=False)]
            normalized.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        return ChoicesDecision(choices[_argmax(normalized)], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=normalized, scores=normalized))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
sum_logprobs = SumLogprobs()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

# By the exported objects' names, as SGLang programs spell them, and by short names.
_BY_NAME: dict[str, ChoicesSamplingMethod] = {
    "token_length_normalized": token_length_normalized,
    "greedy_token_selection": greedy_token_selection, "greedy": greedy_token_selection,
    "sum_logprobs": sum_logprobs, "sum": sum_logprobs,
    "unconditional_likelihood_normalized": unconditional_likelihood_normalized,
}


def choices_method(method: Any) -> Any:
    """`method` as a choices method: None is the default, a name one of the built-in ones;
    any other callable (a `ChoicesSamplingMethod` of the program's own) is used as is."""
    if method is None:
        return token_length_normalized
    if isinstance(method, str):
        try:
            return _BY_NAME[method]
        except KeyError:
            raise ValueError(f"choices_method must be one of {sorted(_BY_NAME)} or a "
                             f"ChoicesSamplingMethod, got {method!r}") from None
    if not callable(method):
        raise TypeError(f"choices_method must be a ChoicesSamplingMethod (a callable) or "
                        f"the name of one, got {method!r}")
    return method


def decide(method: Any, choices: list[str], logprobs: list[list[float]],
           unconditional: list[list[float | None]] | None = None) -> tuple[int, dict[str, Any]]:
    """Run `method` on each choice's token logprobs (and, if it needs them, each choice's
    unconditional ones): (index of the chosen choice, the decision's meta info)."""
    inputs = [[(v, None, None) for v in lp] for lp in logprobs]
    normalized = [mean_logprob(t) for t in inputs]
    uncond = None if unconditional is None else [[(v, None, None) for v in lp]
                                                  for lp in unconditional]
    decision = method(choices=list(choices), normalized_prompt_logprobs=normalized,
                      input_token_logprobs=inputs, output_token_logprobs=[[] for _ in choices],
                      unconditional_token_logprobs=uncond)
    if decision.decision not in choices:
        raise ValueError(f"the choices method {method!r} chose {decision.decision!r}, "
                         f"which is not one of the choices")
    return choices.index(decision.decision), dict(decision.meta_info or {})
