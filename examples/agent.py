"""A tool-using agent whose every step is a well-formed call: JSON-constrained decoding.

    python examples/agent.py                 # (`make demo`) on the embedded SmolLM2-135M
    python examples/agent.py --question "What is 12 * (7 + 5)?" --max-steps 3

The tool prompt (the tools' JSON Schemas and two worked examples) is pinned once: every
question's session starts from it without recomputing it. Each step the model writes one
call, ``{"name": ..., "arguments": {...}}``, generated under the JSON Schema of "a call of
one of the tools" (`gen(json_schema=...)`): even a 135M model cannot produce a call that
does not parse or names no tool, and the engine's jump-forward appends the fixed parts
(``{"name": "``, ``", "arguments": {"``...) without decoding them. The SDK runs the tool
and appends the observation; each call and result is printed, with the share of the
step's prompt served from the cache.

Tools: `calculator` (arithmetic through a whitelist of `ast` nodes, never `eval`),
`search_files` (lines mentioning a word, in the notes folder; a small one is written to a
temporary directory unless `--folder` names another) and `finish` (the answer).
"""

from __future__ import annotations

import ast
import json
import operator
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import radixlm as rl
from _common import cache_report, open_backend, parser

TOOLS: dict[str, dict[str, Any]] = {
    "calculator": {
        "description": "computes an arithmetic expression",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
            "required": ["expression"], "additionalProperties": False},
    },
    "search_files": {
        "description": "finds the lines of the notes that mention a word",
        "parameters": {"type": "object", "properties": {
            "word": {"type": "string", "pattern": "^[A-Za-z]{2,20}$"}},
            "required": ["word"], "additionalProperties": False},
    },
    "finish": {
        "description": "gives the final answer",
        "parameters": {"type": "object", "properties": {
            "answer": {"type": "string", "maxLength": 60}},
            "required": ["answer"], "additionalProperties": False},
    },
}  # fmt: skip


def call_schema(names: list[str]) -> dict[str, Any]:
    """JSON Schema of one call of any tool in `names`."""
    return {"anyOf": [
        {"type": "object", "properties": {"name": {"const": n},
                                          "arguments": TOOLS[n]["parameters"]},
         "required": ["name", "arguments"], "additionalProperties": False}
        for n in names
    ]}  # fmt: skip


def _tool_lines() -> str:
    return "\n".join(json.dumps({"name": n, **spec}) for n, spec in TOOLS.items())


TOOL_PROMPT = f"""You are a careful assistant that answers questions with tools.
Each step, answer with only one JSON call {{"name": ..., "arguments": {{...}}}} of these tools:
{_tool_lines()}
Use calculator for arithmetic and search_files for facts in the notes. As soon as an
observation answers the question, call finish with the answer.

Example 1.
Question: What is 6 times 7?
{{"name": "calculator", "arguments": {{"expression": "6 * 7"}}}}
Observation: 42
{{"name": "finish", "arguments": {{"answer": "42"}}}}

Example 2.
Question: Who leads the design team?
{{"name": "search_files", "arguments": {{"word": "design"}}}}
Observation: people.txt: Ana leads the design team.
{{"name": "finish", "arguments": {{"answer": "Ana"}}}}

Example 3.
Question: When is the review?
{{"name": "search_files", "arguments": {{"word": "review"}}}}
Observation: plan.txt: The review is on June 2.
{{"name": "finish", "arguments": {{"answer": "June 2"}}}}"""

NOTES = {
    "launch.txt": "The Aurora launch is scheduled for March 14.\nThe launch site is Kourou.\n",
    "team.txt": "Aurora has five engineers.\nMaya leads the propulsion team.\n",
    "budget.txt": "The Aurora budget is 1200 dollars per month.\n",
}

PIN = "json-tools"
QUESTIONS = ["What is 17 * 23 + 4?", "When is the Aurora launch?"]


# -- tools ---------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate arithmetic: numbers, + - * / // % ** and parentheses, nothing else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def search_files(folder: Path, query: str) -> str:
    """Lines of the folder's text files that mention the query's first word."""
    words = query.strip().strip(".?!\"'").split()
    if not words:
        return "error: empty query"
    word = words[0].lower()
    hits = []
    for path in sorted(folder.glob("*")):
        if path.suffix not in (".txt", ".md") or not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if word in line.lower():
                hits.append(f"{path.name}: {line.strip()}")
    return "; ".join(hits[:3]) if hits else f"no line mentions {word!r}"


# -- the agent -------------------------------------------------------------------------------


@rl.function
def agent(s, question: str, folder: Path, max_steps: int, max_tokens: int):
    s += rl.user(f"Question: {question}")
    calls: set[tuple[str, str]] = set()
    for step in range(max_steps):
        # The first step must use a tool (a small model would otherwise guess an answer).
        names = list(TOOLS) if step else [n for n in TOOLS if n != "finish"]
        s += rl.assistant(rl.gen(f"call{step}", max_tokens=max_tokens,
                                 json_schema=call_schema(names)))
        meta = s.get_meta_info(f"call{step}")
        share = meta["cached_tokens"] / meta["prompt_tokens"]
        text = s[f"call{step}"]
        if meta["finish_reason"]["type"] != "stop":  # max_tokens cut the call short
            print(f"  step {step + 1}  (call cut at {max_tokens} tokens: {text!r})")
            return
        call = json.loads(text)  # always parses: the grammar admitted nothing else
        name, args = call["name"], call["arguments"]
        arg = next(iter(args.values()))
        print(f"  step {step + 1}  {name}({json.dumps(args)})", end="")
        if name == "finish":
            print()
            s["answer"] = arg
        elif (name, arg) in calls:  # a small model can loop: stop instead
            print(" again: stopping")
            return
        else:
            calls.add((name, arg))
            observation = calculator(arg) if name == "calculator" else search_files(folder, arg)
            print(f" -> {observation}")
            s += rl.user(f"Observation: {observation}")
        print(f"          [prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} "
              f"cached ({share:.0%})]")
        if name == "finish":
            return


def pin_tool_prompt(engine: rl.Client) -> int:
    """Pin the tool prompt (replacing a stale pin of the same name, which outlives clients)."""
    messages = [{"role": "system", "content": TOOL_PROMPT}]
    try:
        return engine.pin(PIN, messages=messages)
    except rl.DuplicateIdError:
        engine.unpin(PIN)
        return engine.pin(PIN, messages=messages)


def main(argv: list[str] | None = None) -> int:
    p = parser("An agent whose tool calls are JSON-constrained: calculator, file search.",
               max_tokens=64)
    p.add_argument("--question", action="append", default=None,
                   help="question to answer (repeatable; default: two built-in ones)")
    p.add_argument("--max-steps", type=int, default=3, help="steps per question (default: 3)")
    p.add_argument("--folder", type=Path, default=None,
                   help="folder for search_files (default: a temporary one with sample notes)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="radixlm-notes-") as tmp:
        folder = args.folder
        if folder is None:
            folder = Path(tmp)
            for name, text in NOTES.items():
                (folder / name).write_text(text)
        with open_backend(args) as engine:
            length = pin_tool_prompt(engine)
            print(f"pinned the tool prompt ({length} tokens) on {engine.model}")
            start = time.perf_counter()
            try:
                for question in args.question or QUESTIONS:
                    print(f"\nQuestion: {question}")
                    state = agent.run(question=question, folder=folder,
                                      max_steps=args.max_steps, max_tokens=args.max_tokens,
                                      backend=engine, pin=PIN, temperature=0)
                    answer = state.get("answer", "(none within the steps)")
                    print(f"Answer: {answer}")
                stats = engine.stats()
            finally:
                engine.unpin(PIN)
        print(f"\ndone in {time.perf_counter() - start:.1f} s; engine {cache_report(stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
