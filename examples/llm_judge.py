"""LLM-as-a-judge: fork one review into six criteria, judge them in parallel, join.

    python examples/llm_judge.py --max-tokens 48

The question and answer are prefilled once; `s.fork(6)` gives six sessions sharing that
prefix (nothing re-sent), each judging one criterion and scoring it with `select`.
`join()` gathers the six scores back as a list; the judgments are then summed up into
a verdict in the parent.
"""

from __future__ import annotations

import sys
import time

import radixlm as rl
from _common import open_backend, parser

CRITERIA = ["accuracy", "clarity", "conciseness", "helpfulness", "tone", "completeness"]
QUESTION = "Why is the sky blue?"
ANSWER = ("Sunlight is scattered by the molecules of the air. Blue light has a shorter "
          "wavelength, so it is scattered much more than red light, and the scattered blue "
          "light reaches our eyes from every direction of the sky.")


@rl.function
def judge(s, question: str, answer: str, criteria: list[str], max_tokens: int):
    s += rl.system("You are a strict but fair reviewer of answers.")
    s += rl.user(f"Question: {question}\nAnswer: {answer}")
    forks = s.fork(len(criteria))
    for fork, criterion in zip(forks, criteria, strict=True):
        fork += rl.user(f"Judge only the {criterion} of the answer, in one or two sentences.")
        fork += rl.assistant(rl.gen("judgment", max_tokens=max_tokens))
        fork += rl.user(f"Score its {criterion} from 1 (bad) to 5 (excellent). Answer with the "
                        "number only.")
        fork += rl.assistant(rl.select("score", choices=["1", "2", "3", "4", "5"]))
    forks.join()
    notes = "\n".join(f"{c}: {j.strip()}" for c, j in zip(criteria, s["judgment"], strict=True))
    s += rl.user(f"Your notes:\n{notes}\nGive an overall verdict in one sentence.")
    s += rl.assistant(rl.gen("verdict", max_tokens=max_tokens))


def main(argv: list[str] | None = None) -> int:
    p = parser("Judge an answer on six criteria with forks.", max_tokens=40)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--answer", default=ANSWER)
    p.add_argument("--criteria", type=lambda k: CRITERIA[: int(k)], default=CRITERIA,
                   metavar="K", help=f"judge only the first K of the {len(CRITERIA)} criteria "
                                     "(default: all)")
    args = p.parse_args(argv)
    criteria = args.criteria
    with open_backend(args) as engine:
        start = time.perf_counter()
        state = judge.run(question=args.question, answer=args.answer, criteria=criteria,
                          max_tokens=args.max_tokens, backend=engine, temperature=0)
        elapsed = time.perf_counter() - start
        print(f"Question: {args.question}\nAnswer: {args.answer}\n")
        metas = state.get_meta_info("judgment")
        for criterion, score, judgment, meta in zip(criteria, state["score"], state["judgment"],
                                                    metas, strict=True):
            print(f"  {criterion:<13} {score}/5  {judgment.strip()}")
            print(f"  {'':<13}      [prompt {meta['prompt_tokens']} tokens, "
                  f"{meta['cached_tokens']} cached]")
        scores = [int(x) for x in state["score"]]
        print(f"\nmean score {sum(scores) / len(scores):.1f}/5; verdict:{state['verdict']}")
        print(f"({elapsed:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
