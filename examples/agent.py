"""A ReAct agent with real Python tools, on a pinned tool prompt.

    python examples/agent.py                 # (`make demo`) on the embedded SmolLM2-135M
    python examples/agent.py --question "What is 12 * (7 + 5)?" --max-steps 3

The tool prompt (instructions + two worked examples) is pinned once: every question's
session starts from it without recomputing it. Each step the model thinks (`gen`), picks
a tool with `select` (always a valid tool name), writes the tool's input (`gen`); the SDK
runs the tool and appends the observation. Only the new tokens of each step are computed:
the status line of every step shows the share of its prompt served from the cache.

Tools: `calculator` (arithmetic through a whitelist of `ast` nodes, never `eval`) and
`search_files` (lines mentioning a word, in the notes folder; a small one is written to a
temporary directory unless `--folder` names another).
"""

from __future__ import annotations

import ast
import operator
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import radixlm as rl
from _common import open_backend, parser

TOOL_PROMPT = """You are a careful assistant that answers questions with tools.
Tools:
- calculator: computes an arithmetic expression, for example 12 * (3 + 4)
- search_files: finds the lines of the notes that mention a word
- finish: gives the final answer
Work one step at a time, in this format:
Thought: what to do next
Action: one of calculator, search_files, finish
Action Input: the input of the tool
Use calculator for arithmetic and search_files for facts about the notes. As soon as an
observation answers the question, use finish with the answer.

Example 1.
Question: What is 6 times 7?
Thought: This is arithmetic, so I use the calculator.
Action: calculator
Action Input: 6 * 7
Observation: 42
Thought: The calculator gave the answer.
Action: finish
Action Input: 42

Example 2.
Question: Who leads the design team?
Thought: The notes may say who leads the design team.
Action: search_files
Action Input: design
Observation: people.txt: Ana leads the design team.
Thought: The notes give the answer.
Action: finish
Action Input: Ana"""

NOTES = {
    "launch.txt": "The Aurora launch is scheduled for March 14.\nThe launch site is Kourou.\n",
    "team.txt": "Aurora has five engineers.\nMaya leads the propulsion team.\n",
    "budget.txt": "The Aurora budget is 1200 dollars per month.\n",
}

PIN = "react-tools"
QUESTIONS = ["What is 17 * 23 + 4?", "When is the Aurora launch?"]
ACTIONS = ["calculator", "search_files", "finish"]


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
def react(s, question: str, folder: Path, max_steps: int, max_tokens: int):
    s += rl.user(f"Question: {question}")
    calls: set[tuple[str, str]] = set()
    for step in range(max_steps):
        s += rl.assistant_begin()
        s += "Thought:" + rl.gen(f"thought{step}", max_tokens=max_tokens, stop=["\n"])
        # The first step must use a tool (a small model would otherwise guess an answer).
        # Greedy token selection: the first token decides, so a long name whose later
        # tokens are easy to predict does not win on its mean logprob.
        choices = ACTIONS if step else [a for a in ACTIONS if a != "finish"]
        s += "\nAction: " + rl.select(f"action{step}", choices=choices,
                                      choices_method=rl.greedy_token_selection)
        s += "\nAction Input:" + rl.gen(f"input{step}", max_tokens=max_tokens, stop=["\n"])
        s += rl.assistant_end()
        action, arg = s[f"action{step}"], s[f"input{step}"].strip()
        meta = s.get_meta_info(f"thought{step}")
        share = meta["cached_tokens"] / meta["prompt_tokens"]
        print(f"  step {step + 1}  Thought:{s[f'thought{step}']}")
        if action == "finish":
            print(f"          finish({arg!r})")
            s["answer"] = arg
        elif (action, arg) in calls:  # a small model can loop: stop instead
            print(f"          {action}({arg!r}) again: stopping")
            return
        else:
            calls.add((action, arg))
            observation = calculator(arg) if action == "calculator" else search_files(folder, arg)
            print(f"          {action}({arg!r}) -> {observation}")
            s += rl.user(f"Observation: {observation}")
        print(f"          [prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} "
              f"cached ({share:.0%})]")
        if action == "finish":
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
    p = parser("A ReAct agent with a calculator and file search.", max_tokens=32)
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
                    state = react.run(question=question, folder=folder,
                                      max_steps=args.max_steps, max_tokens=args.max_tokens,
                                      backend=engine, pin=PIN, temperature=0)
                    answer = state.get("answer", "(none within the steps)")
                    print(f"Answer: {answer}")
                stats = engine.stats()
            finally:
                engine.unpin(PIN)
        print(f"\ndone in {time.perf_counter() - start:.1f} s; engine cache hit rate "
              f"{stats['hit_rate']:.0%} ({stats['cached_tokens_total']} of "
              f"{stats['prompt_tokens_total']} prompt tokens served from the cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
