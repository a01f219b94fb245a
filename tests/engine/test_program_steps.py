"""The program policy's steps where prefill is preemptible (prefill.py, slicing.py): a
step's prompt work is one program's; a program that outranks the prompt work in progress
is admitted at once, beside the slice; a slice waits while a program ranked above its own
decodes. Checked step by step in the scheduler (one piece a slice), outputs against
transformers' greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from radixlm.runtime.engine.state import ReqState
from scheduler_harness import (  # noqa: F401 - the fixtures
    hf,
    hf_greedy,
    make_harness,
    random_prompt,
    tiny_dir,
)

pytestmark = pytest.mark.timeout(300)
# One piece a slice; chunks of 64 tokens; every chunk of 32+ tokens sliced (the program
# policy's threshold).
STEPS = dict(policy="program", chunked_prefill=64, max_running=8, prefill_slice_rows=8,
             prefill_slice_ms=1e-6)


def prompt_programs(h) -> set[str]:  # noqa: ANN001
    return {r.group.program for r in h.sched.running if r.state is ReqState.PREFILLING}


def test_one_program_prompt_a_step_and_slices_wait_for_higher_decodes(make_harness, hf) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(11)
    h = make_harness(**STEPS)
    progs = h.sched.prefill.programs
    slicer = h.sched.slicer
    prompts = {name: random_prompt(rng, n) for name, n in
               (("a1", 40), ("a2", 34), ("b", 100), ("c", 40))}
    keys = {name: h.generate(p, max_tokens=6, program=name[0]) for name, p in prompts.items()}
    yielded = admitted_together = 0
    while h.sched.has_work():
        cur = slicer.current
        before = cur.task.pieces_run if cur is not None else None
        outranked = cur is not None and any(
            r.state is ReqState.DECODING and progs.rank(r) < progs.rank(cur.entry.req)
            for r in h.sched.running)
        h.step()
        assert len(prompt_programs(h)) <= 1, prompt_programs(h)
        if outranked and slicer.current is cur:
            assert cur.task.pieces_run == before, "a slice ran while a higher program decoded"
            yielded += 1
        mine = [r for r in h.sched.running if r.group.key in (keys["a1"], keys["a2"])]
        admitted_together += len(mine) == 2 and all(r.state is ReqState.PREFILLING for r in mine)
        assert h.steps < 2000
    assert yielded >= 5  # b's slice waited for a's decode steps
    assert admitted_together  # a1 and a2 are one program: their prompts run together
    for name, p in prompts.items():
        assert h.output(keys[name]) == hf_greedy(hf, p, 6)


def test_a_higher_program_is_admitted_beside_a_lower_slice(make_harness, hf) -> None:  # noqa: ANN001, F811
    """`a` came first: its next request outranks `b`'s prompt, sliced meanwhile, and runs
    before that slice is done."""
    rng = np.random.default_rng(12)
    h = make_harness(**STEPS)
    first, long, nxt = random_prompt(rng, 10), random_prompt(rng, 60), random_prompt(rng, 12)
    a = h.generate(first, max_tokens=2, program="a")
    b = h.generate(long, max_tokens=3, program="b")
    while not h.sched.slicer.current or h.sched.slicer.current.entry.req.group.key != b:
        h.step()
    task = h.sched.slicer.current.task
    a2 = h.generate(nxt, max_tokens=3, program="a")
    for _ in range(3):
        h.step()
    running = {r.group.key for r in h.sched.running}
    assert a2 in running and h.sched.slicer.current is not None
    assert task.pieces_run < task.total_pieces
    h.run()
    assert h.output(a) == hf_greedy(hf, first, 2)
    assert h.output(b) == hf_greedy(hf, long, 3)
    assert h.output(a2) == hf_greedy(hf, nxt, 3)


def test_without_slices_several_programs_share_a_step(make_harness, hf) -> None:  # noqa: ANN001, F811
    """Where prefill cannot be preempted (no slices), the program policy only orders
    admission: two programs' prompts are admitted in one step."""
    rng = np.random.default_rng(13)
    h = make_harness(**{**STEPS, "prefill_slice_ms": 0})
    assert not h.sched.prefill.one_program
    prompts = [random_prompt(rng, 20), random_prompt(rng, 20)]
    keys = [h.generate(p, max_tokens=3, program=f"p{i}") for i, p in enumerate(prompts)]
    h.step()
    assert {r.group.key for r in h.sched.running} == set(keys)
    h.run()
    for k, p in zip(keys, prompts, strict=True):
        assert h.output(k) == hf_greedy(hf, p, 3)
