"""``rl.separate_reasoning``: a reasoning model's thinking block split from its answer,
as SGLang's reasoning parsers do it for the model families that mark thinking with tags.

    s += rl.assistant(rl.separate_reasoning(rl.gen("answer"), model_type="qwen3"))
    s["answer"]                     # the answer, without the <think>...</think> block
    s["answer_reasoning_content"]   # what was inside it

A model type either always starts in thinking (``forced``: the text before the end tag is
reasoning even without an opening tag, as DeepSeek-R1 writes it) or thinks only inside an
opening tag. Text without an end tag after an opening (or forced) start is all reasoning
(the generation stopped while thinking).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["REASONING_FORMATS", "ReasoningFormat", "reasoning_format", "reasoning_name",
           "split_reasoning"]


class ReasoningFormat(NamedTuple):
    start: str
    end: str
    forced: bool  # in reasoning from the first token, opening tag or not


_THINK = ("<think>", "</think>")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, forced=True),
    "step3": ReasoningFormat(*_THINK, forced=True),
    "step3p5": ReasoningFormat(*_THINK, forced=True),
    "gigachat35": ReasoningFormat(*_THINK, forced=True),
    "qwen3": ReasoningFormat(*_THINK, forced=False),
    "qwen3-thinking": ReasoningFormat(*_THINK, forced=True),
    "minimax": ReasoningFormat(*_THINK, forced=True),
    "dots": ReasoningFormat(*_THINK, forced=False),
    "nanbeige": ReasoningFormat(*_THINK, forced=False),
    "interns1": ReasoningFormat(*_THINK, forced=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", forced=False),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    """The tags of `model_type` (SGLang's reasoning-parser names, case-insensitive)."""
    if not model_type:
        raise ValueError("separate_reasoning() needs model_type= (one of "
                         f"{', '.join(sorted(REASONING_FORMATS))})")
    found = REASONING_FORMATS.get(model_type.lower())
    if found is None:
        raise ValueError(f"separate_reasoning(): unsupported model_type {model_type!r}; "
                         f"supported: {', '.join(sorted(REASONING_FORMATS))}")
    return found


def reasoning_name(name: str | None) -> str:
    """The variable that receives the reasoning of variable `name` (SGLang's naming)."""
    if not name:
        raise ValueError("separate_reasoning() needs a named gen or select (its reasoning "
                         "goes to the variable '<name>_reasoning_content')")
    return f"{name}_reasoning_content"


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str, str]:
    """(reasoning, answer) of one generated text."""
    if not (fmt.forced or fmt.start in text):
        return "", text
    body = text
    while body.startswith(fmt.start):  # a leading opening tag (repeated, even) goes
        body = body[len(fmt.start):]
    if fmt.end not in body:
        return body, ""
    reasoning, answer = body.split(fmt.end, 1)
    return reasoning, answer
