"""Batch classification: `select` over fixed labels, many inputs at once with `run_batch`.

    python examples/classify.py

Every program shares the instructions and examples, so the engine keeps them cached and
computes only each review; `run_batch` runs the programs concurrently as anyio tasks in
one event loop (no thread per program), and each `select` scores its labels in forked
sessions instead of re-sending the prompt.
"""

from __future__ import annotations

import sys
import time

import radixlm as rl
from _common import cache_report, open_backend, parser

LABELS = ["positive", "negative", "neutral"]
INSTRUCTIONS = """Classify the sentiment of a product review as positive, negative or neutral. Answer with
the label only.
Examples:
Review: I love it, it works perfectly. -> positive
Review: It broke after one day, a waste of money. -> negative
Review: It arrived on Tuesday. -> neutral"""
REVIEWS = [
    "Absolutely fantastic, I would buy it again.",
    "Terrible quality, it stopped working within a week.",
    "The box was blue.",
    "Great value for the price, very happy.",
    "Customer service never answered my emails.",
    "It does what it says.",
    "The battery lasts forever, amazing!",
    "Cheap plastic, feels like it will break.",
]


@rl.function
def classify(s, review: str):
    s += rl.system(INSTRUCTIONS)
    s += rl.user(f"Review: {review}")
    s += rl.assistant(rl.select("label", choices=LABELS))


def main(argv: list[str] | None = None) -> int:
    p = parser("Classify reviews in a batch with select.", max_tokens=1)
    p.add_argument("--concurrency", type=int, default=8, help="programs at once (default: 8)")
    p.add_argument("--limit", type=int, default=len(REVIEWS),
                   help=f"classify only the first N of the {len(REVIEWS)} sample reviews")
    args = p.parse_args(argv)
    reviews = REVIEWS[: args.limit]
    with open_backend(args) as engine:
        start = time.perf_counter()
        states = classify.run_batch([{"review": r} for r in reviews], backend=engine,
                                    max_concurrency=args.concurrency, progress_bar=False)
        elapsed = time.perf_counter() - start
        for review, state in zip(reviews, states, strict=True):
            scores = state.get_meta_info("label")["normalized_prompt_logprobs"]
            confidence = max(scores)
            print(f"  {state['label']:<9} ({confidence:6.2f})  {review}")
        print(f"\n{len(reviews)} reviews in {elapsed:.1f} s "
              f"({len(reviews) / elapsed:.1f}/s, up to {engine.aclient.peak_generating} "
              f"requests in flight); {cache_report(engine.stats())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
