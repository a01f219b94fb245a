"""The scheduler's lifecycle against independent references: HF transformers for greedy
tokens and prompt logprobs, and plain arithmetic for cache hits and computed tokens."""

from __future__ import annotations

import numpy as np
import pytest
import scheduler_harness as harness
import torch
from radixlm.runtime.engine.state import IllegalTransition, ReqState, advance
from radixlm.runtime.engine.wire import EngineAbort
from radixlm.runtime.protocol import Error, ErrorCode, SamplingParams
from scheduler_harness import (
    CONTEXT,
    hf_greedy,
    hf_prompt_logprobs,
    output_text,
    random_prompt,
    stop_inside,
)

# The harness fixtures, by name.
hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity


def shared_prompts(seed: int, n: int, shared: int, tail: tuple[int, int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = random_prompt(rng, shared)
    return [prefix + random_prompt(rng, int(rng.integers(*tail))) for _ in range(n)]


def test_state_table_rejects_illegal_transitions():
    class Obj:
        state = ReqState.WAITING

    o = Obj()
    with pytest.raises(IllegalTransition):  # a request ends only after running
        advance(o, ReqState.FINISHED)
    advance(o, ReqState.PREFILLING)
    advance(o, ReqState.DECODING)
    with pytest.raises(IllegalTransition):
        advance(o, ReqState.PREFILLING)
    advance(o, ReqState.RETRACTED)
    advance(o, ReqState.WAITING)
    advance(o, ReqState.ABORTED)
    with pytest.raises(IllegalTransition):
        advance(o, ReqState.WAITING)


def test_concurrent_batch_equals_alone_and_hf(make_harness, hf):
    prompts = shared_prompts(0, 5, 20, (3, 30))
    prompts.append(random_prompt(np.random.default_rng(9), 7))  # unrelated
    n_new = 10
    h = make_harness()
    keys = [h.generate(p, max_tokens=n_new) for p in prompts]
    h.run()
    alone = make_harness()
    for p, k in zip(prompts, keys, strict=True):
        ref = hf_greedy(hf, p, n_new)
        assert h.output(k) == ref
        ka = alone.generate(p, max_tokens=n_new)
        alone.run()
        assert alone.output(ka) == ref
        alone.sched.flush_cache()
        assert h.final[(k, 0)].finish_reason == "length"
        assert h.final[(k, 0)].usage.completion_tokens == n_new


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_tokens_are_the_shared_prefix(make_harness, page_size):
    prompts = shared_prompts(1, 4, 40, (5, 20))
    h = make_harness(page_size=page_size)
    first = h.generate(prompts[0], max_tokens=4)
    h.run()
    keys = [h.generate(p, max_tokens=4) for p in prompts[1:]]
    h.run()
    assert h.final[(first, 0)].usage.cached_tokens == 0
    for p, k in zip(prompts[1:], keys, strict=True):
        usage = h.final[(k, 0)].usage
        assert usage.prompt_tokens == len(p)
        assert usage.cached_tokens == 40 - 40 % page_size


def test_in_batch_dedup_prefills_a_new_shared_prefix_once(make_harness, hf):
    prompts = shared_prompts(2, 4, 48, (4, 12))
    h = make_harness(dedup_min_tokens=32)
    keys = [h.generate(p, max_tokens=3) for p in prompts]
    h.run()
    tails = sum(len(p) - 48 for p in prompts)
    assert h.sched.counters.computed_tokens == 48 + tails
    for p, k in zip(prompts, keys, strict=True):
        assert h.output(k) == hf_greedy(hf, p, 3)
    assert [h.final[(k, 0)].usage.cached_tokens for k in keys] == [0, 48, 48, 48]


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_gives_the_unchunked_tokens(make_harness, hf, page_size):
    rng = np.random.default_rng(3)
    prompts = [random_prompt(rng, 100), random_prompt(rng, 37)]
    h = make_harness(chunked_prefill=16, page_size=page_size)
    keys = [h.generate(p, max_tokens=6) for p in prompts]
    h.run()
    assert h.steps >= (100 + 37) // 16
    for p, k in zip(prompts, keys, strict=True):
        assert h.output(k) == hf_greedy(hf, p, 6)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_a_tiny_pool_loses_nothing(make_harness, hf, page_size):
    prompts = shared_prompts(4, 5, 8, (20, 30))
    n_new = 24
    # Room for about three of the five sequences at once; admission trusts the pool
    # (ratio 0), so running decodes must retract to finish.
    h = make_harness(capacity=160, page_size=page_size, init_new_token_ratio=0.0,
                     min_new_token_ratio=0.0)
    keys = [h.generate(p, max_tokens=n_new) for p in prompts]
    h.run()
    assert h.sched.counters.retractions > 0
    for p, k in zip(prompts, keys, strict=True):
        assert h.output(k) == hf_greedy(hf, p, n_new)
        assert h.final[(k, 0)].usage.completion_tokens == n_new


def test_abort_frees_private_kv(make_harness):
    rng = np.random.default_rng(5)
    h = make_harness(page_size=4)
    running = h.generate(random_prompt(rng, 30), max_tokens=50)
    queued = h.generate(random_prompt(rng, 30), max_tokens=50)
    h.step()
    h.step()
    h.send(EngineAbort(key=running))
    assert h.final[(running, 0)].finish_reason == "abort"
    assert 0 < len(h.tokens[(running, 0)]) < 50
    h.send(EngineAbort(key=queued))
    h.send(EngineAbort(key=12345))  # unknown keys are ignored
    assert h.final[(queued, 0)].finish_reason == "abort"
    assert h.sched.private_tokens() == 0 and not h.sched.has_work()
    # The computed prompt stayed as evictable cache; nothing is protected or private.
    sizes = h.cache.sizes()
    assert sizes.protected == 0 and sizes.evictable >= 28


def test_a_stop_string_ends_the_branch_at_exactly_the_kept_tokens(make_harness, hf):
    """The engine matches stop strings itself: tokens that may begin one are held back,
    the branch ends keeping the shortest prefix whose text covers what precedes the stop,
    and only that prefix joins the tree."""
    prompt = random_prompt(np.random.default_rng(6), 25)
    ref = hf_greedy(hf, prompt, 30)
    h = make_harness()
    stop, kept, before = stop_inside(h.tokenizer, prompt, ref, 4)
    key = h.generate(prompt, sampling=SamplingParams(max_tokens=30, temperature=0.0,
                                                     ignore_eos=True, stop=[stop]))
    h.run()
    final = h.final[(key, 0)]
    assert (final.finish_reason, final.matched_stop) == ("stop", stop)
    assert h.output(key) == ref[:kept]  # nothing past the kept tokens was ever sent
    assert final.usage.completion_tokens == kept
    assert output_text(h.tokenizer, prompt, ref[:kept])[: len(before)] == before
    trimmed = output_text(h.tokenizer, prompt, ref[:kept])
    assert trimmed[: len(trimmed) - final.text_trim] == before
    # Prompt + the kept tokens are cached; what was computed past them never joined.
    m = h.cache.match(prompt + ref[:30])
    assert m.length == len(prompt) + kept
    assert h.sched.private_tokens() == 0


def test_stop_token_ids_and_eos(make_harness, hf):
    prompt = random_prompt(np.random.default_rng(7), 20)
    ref = hf_greedy(hf, prompt, 12)
    stop = next(t for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    at = ref.index(stop)
    h = make_harness(eos=(stop,))
    k_stop = h.generate(prompt, sampling=SamplingParams(max_tokens=12, temperature=0.0,
                                                        stop_token_ids=[stop], ignore_eos=True))
    k_eos = h.generate(prompt, max_tokens=12, ignore_eos=False)
    k_ignore = h.generate(prompt, max_tokens=12, ignore_eos=True)
    h.run()
    for k in (k_stop, k_eos):
        assert h.output(k) == ref[: at + 1]
        assert (h.final[(k, 0)].finish_reason, h.final[(k, 0)].matched_stop) == ("stop", stop)
    assert h.output(k_ignore) == ref
    assert h.final[(k_ignore, 0)].finish_reason == "length"


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_logprobs_match_hf_even_when_cached(make_harness, hf, page_size):
    prompt = random_prompt(np.random.default_rng(8), 60)
    start = 20
    ref = hf_prompt_logprobs(hf, prompt, start)
    h = make_harness(page_size=page_size, chunked_prefill=24)
    warm = h.generate(prompt, max_tokens=1)  # the whole prompt is now cached
    h.run()
    key = h.generate(prompt, max_tokens=0, prompt_logprobs_start=start)
    h.run()
    final = h.final[(key, 0)]
    assert final.finish_reason == "length" and h.tokens[(key, 0)] == []
    got = np.asarray(final.prompt_logprobs)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=2e-4)
    # The match was capped at the first scored position: everything from there recomputed.
    assert final.usage.cached_tokens <= start - 1
    assert h.final[(warm, 0)].usage.cached_tokens == 0


def test_logprobs_of_sampled_tokens(make_harness, hf):
    prompt = random_prompt(np.random.default_rng(10), 16)
    h = make_harness()
    key = h.generate(prompt, sampling=SamplingParams(max_tokens=4, temperature=0.0,
                                                     logprobs=True, top_logprobs=2))
    h.run()
    out = h.output(key)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out)]
    np.testing.assert_allclose(h.logprobs[(key, 0)], want, atol=2e-4)
    assert out == hf_greedy(hf, prompt, 4)


def test_n_branches_share_one_prefill(make_harness):
    prompt = random_prompt(np.random.default_rng(11), 40)
    h = make_harness()
    key = h.generate(prompt, n=3, sampling=SamplingParams(max_tokens=6, temperature=1.0,
                                                          seed=1234, ignore_eos=True))
    h.run()
    outs = [h.output(key, i) for i in range(3)]
    # One prefill of the prompt, then each other branch recomputes only its last token.
    assert h.sched.counters.computed_tokens == len(prompt) + 2
    assert [h.final[(key, i)].usage.cached_tokens for i in range(3)] == [0, 39, 39]
    # Branch i is a seeded request of seed + i, whatever else shares its batches.
    for i in range(3):
        single = h.generate(prompt, sampling=SamplingParams(max_tokens=6, temperature=1.0,
                                                            seed=1234 + i, ignore_eos=True))
        h.run()
        assert h.output(single) == outs[i]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "shortest-prefill-first"])
def test_every_policy_finishes_a_mixed_workload(make_harness, hf, policy, page_size):
    rng = np.random.default_rng(12)
    a, b = random_prompt(rng, 36), random_prompt(rng, 20)
    prompts = [a + random_prompt(rng, 5), b + random_prompt(rng, 30), a + random_prompt(rng, 9),
               random_prompt(rng, 70), b + random_prompt(rng, 3), a + random_prompt(rng, 2)]
    h = make_harness(policy=policy, page_size=page_size, chunked_prefill=32, max_running=4,
                     capacity=512)
    keys = [h.generate(p, max_tokens=4 + i % 3) for i, p in enumerate(prompts)]
    branched = h.generate(a, n=2, sampling=SamplingParams(max_tokens=3, temperature=0.0,
                                                          ignore_eos=True))
    h.run()
    for i, (p, k) in enumerate(zip(prompts, keys, strict=True)):
        assert h.output(k) == hf_greedy(hf, p, 4 + i % 3)
    assert h.output(branched, 0) == h.output(branched, 1) == hf_greedy(hf, a, 3)


def test_refusals_leave_the_engine_serving(make_harness):
    h = make_harness(capacity=256)
    rng = np.random.default_rng(13)
    h.generate(random_prompt(rng, 10), max_tokens=CONTEXT)  # beyond the context
    h.generate(random_prompt(rng, 200), max_tokens=100)  # beyond context and pool
    h.generate([], max_tokens=4)
    h.generate(random_prompt(rng, 10), prompt_logprobs_start=11)  # past the input
    h.generate(random_prompt(rng, 10), session="nope")  # no session manager here
    codes = [r.code for r in h.replies if isinstance(r, Error)]
    assert codes == [ErrorCode.TOO_LONG, ErrorCode.TOO_LONG, ErrorCode.EMPTY_PROMPT,
                     ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_PARAMS]
    # The frontend is told each key is over (finish_reason "error": drop it, no Done).
    assert sorted(o.finish_reason for o in h.final.values()) == ["error"] * 5
    ok = h.generate(random_prompt(rng, 10), max_tokens=3)
    h.run()
    assert len(h.output(ok)) == 3


def test_a_failing_forward_fails_its_batch_and_nothing_else(make_harness, hf):
    h = make_harness()
    real = h.runner.forward
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real(batch)

    h.sched.model.forward = flaky
    rng = np.random.default_rng(14)
    first = h.generate(random_prompt(rng, 12), max_tokens=5)
    h.step()  # prefill ok
    h.step()  # decode fails
    errors = [r for r in h.replies if isinstance(r, Error)]
    assert [e.code for e in errors] == [ErrorCode.INTERNAL]
    assert h.final[(first, 0)].finish_reason == "error"
    assert h.sched.private_tokens() == 0
    p = random_prompt(rng, 12)
    later = h.generate(p, max_tokens=5)
    h.run()
    assert h.output(later) == hf_greedy(hf, p, 5)

