"""Admission while a long chunked prefill runs (issue 24): another client's new request is
admitted within one step and gets its first token within a few, not after the long
prompt's last chunk; the long prompt still gets the budget the new one leaves, and both
outputs are the model's own (HF transformers' greedy tokens)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import (  # noqa: F401 - the fixtures
    hf,
    hf_greedy,
    make_harness,
    random_prompt,
    tiny_dir,
)

pytestmark = pytest.mark.timeout(300)
BUDGET = 8
LONG = 200  # 25 chunks of 8


def test_a_new_request_is_not_held_behind_a_long_prefill(make_harness, hf) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(24)
    h = make_harness(chunked_prefill=BUDGET, max_running=8)
    long_prompt = random_prompt(rng, LONG)
    short_prompt = random_prompt(rng, 6)
    long = h.generate(long_prompt, max_tokens=4, client=b"a")
    h.step()
    h.step()  # the long prompt is being prefilled in chunks
    short = h.generate(short_prompt, max_tokens=4, client=b"b")
    steps = 0
    while not h.tokens[(short, 0)]:
        h.step()
        steps += 1
        assert steps <= 3, "the short request waited behind the long prefill"
    assert not h.tokens[(long, 0)]  # the long prompt is still being prefilled
    h.run()
    assert h.output(short) == hf_greedy(hf, short_prompt, 4)
    assert h.output(long) == hf_greedy(hf, long_prompt, 4)


def test_the_long_prefill_keeps_what_the_new_request_leaves(make_harness) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(7)
    h = make_harness(chunked_prefill=BUDGET, max_running=8)
    long = h.generate(random_prompt(rng, LONG), max_tokens=2, client=b"a")
    h.generate(random_prompt(rng, 4), max_tokens=2, client=b"b")
    steps = 0
    while not h.tokens[(long, 0)]:
        h.step()
        steps += 1
    # alone it takes LONG / BUDGET steps; the 4-token newcomer costs it one step at most
    assert steps <= LONG // BUDGET + 1, steps
    h.run()
