"""Tree of thought: nested forks explore ideas, a `select` judges every leaf.

    python examples/tree_of_thought.py --width 2 --depth 2

Each level forks every state into `width` children (one engine ForkSession: the shared
reasoning so far is never recomputed); each child writes one idea; leaves are judged
with `select`. The tree and its verdicts print at the end, with the engine's cache
counters: most prompt tokens of the whole tree are served from the prefix cache.
"""

from __future__ import annotations

import sys
import time

import radixlm as rl
from _common import open_backend, parser

QUESTION = "How can a small town reduce its traffic jams?"


def grow(s, width: int, depth: int, max_tokens: int, label: str) -> list:
    """Fork `s` into `width` ideas, recursively; returns [(label, state, children)]."""
    forks = s.fork(width)
    nodes = []
    for i, child in enumerate(forks):
        name = f"{label}{i + 1}"
        child += f"\nIdea {name}:" + rl.gen("idea", max_tokens=max_tokens, stop=["\n"])
        if depth > 1:
            nodes.append((name, child, grow(child, width, depth - 1, max_tokens, name + ".")))
        else:
            child += "\nIs this a good plan? Answer:" + rl.select("verdict", choices=[" yes", " no"])
            nodes.append((name, child, []))
    return nodes


@rl.function
def tree_of_thought(s, question: str, width: int, depth: int, max_tokens: int):
    s += rl.system("You are a practical planner. Write short, concrete ideas.")
    s += rl.user(question)
    s += rl.assistant_begin()
    s += "Let me explore a few ideas, step by step."
    return grow(s, width, depth, max_tokens, "")


def show(nodes: list, indent: str = "  ") -> None:
    for name, state, children in nodes:
        verdict = f"  -> good plan?{state['verdict']}" if not children else ""
        print(f"{indent}{name}:{state['idea']}{verdict}")
        show(children, indent + "  ")


def main(argv: list[str] | None = None) -> int:
    p = parser("Tree of thought with nested forks.", max_tokens=24)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--width", type=int, default=2, help="children per node (default: 2)")
    p.add_argument("--depth", type=int, default=3, help="levels of ideas (default: 3)")
    args = p.parse_args(argv)
    with open_backend(args) as engine:
        before = engine.stats()
        start = time.perf_counter()
        state = tree_of_thought.run(question=args.question, width=args.width, depth=args.depth,
                                    max_tokens=args.max_tokens, backend=engine, temperature=0.7,
                                    seed=0)
        elapsed = time.perf_counter() - start
        print(f"Question: {args.question}")
        show(state.ret_value)
        after = engine.stats()
    prompt = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    print(f"\n{elapsed:.1f} s; {cached} of {prompt} prompt tokens came from the prefix cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
