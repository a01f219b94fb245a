"""The SDK end to end on the real engine (the shared ``server`` fixture: a tiny random
Llama checkpoint on CPU). References are computed independently with HF transformers on
the same checkpoint; the KV pool invariant is checked after every test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import radixlm as rl
from conftest import children_of, pid_from_file, wait_until_gone

pytestmark = pytest.mark.usefixtures("pool_integrity")


@pytest.fixture(scope="module")
def engine(server: Any) -> Iterator[rl.Client]:
    with rl.connect(server.endpoint) as client:
        yield client


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_greedy(hf: tuple[Any, Any], ids: list[int], n: int) -> list[int]:
    import torch

    model, _ = hf
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(ids):]


def hf_logprobs(hf: tuple[Any, Any], ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start."""
    import torch

    model, _ = hf
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [float(logp[i - 1, ids[i]]) for i in range(start, len(ids))]


def first_ids(hf: tuple[Any, Any], text: str) -> list[int]:
    """Text at the start of a session: tokenized with the tokenizer's special tokens."""
    return hf[1].encode(text)


def appended_ids(hf: tuple[Any, Any], text: str) -> list[int]:
    return hf[1].encode(text, add_special_tokens=False)


def test_fork_join_matches_independent_greedy_runs(engine, hf) -> None:
    prefix, suffixes = "The quick brown fox", [" jumps", " runs over", " sleeps"]

    @rl.function
    def branches(s):
        s += prefix
        forks = s.fork(3)
        forks += lambda i: suffixes[i] + rl.gen("next", max_tokens=5, ignore_eos=True)
        forks.join()

    state = branches.run(backend=engine, temperature=0)
    metas = state.get_meta_info("next")
    base = first_ids(hf, prefix)
    for suffix, meta in zip(suffixes, metas, strict=True):
        ids = base + appended_ids(hf, suffix)
        assert meta["output_ids"] == hf_greedy(hf, ids, 5)
        assert meta["prompt_tokens"] == len(ids)
        assert meta["cached_tokens"] >= len(base)  # the forks share the prefix's KV
    assert len(state["next"]) == 3
    assert engine.stats()["sessions"] == 0


def test_select_picks_the_argmax_of_hf_logprobs(engine, hf) -> None:
    prompt = "Hello world! How are you"
    choices = [" today?", " fine", " doing well", "?", " I am fine, thank you."]

    @rl.function
    def pick(s):
        s += prompt
        s += rl.select("answer", choices=choices)

    state = pick.run(backend=engine)
    base = first_ids(hf, prompt)
    means = []
    for choice in choices:
        lps = hf_logprobs(hf, base + appended_ids(hf, choice), len(base))
        means.append(sum(lps) / len(lps))
    ranked = sorted(means)
    assert ranked[-1] - ranked[-2] > 1e-3, "the reference cannot tell the top two apart"
    assert state["answer"] == choices[means.index(ranked[-1])]
    got = state.get_meta_info("answer")["normalized_prompt_logprobs"]
    assert got == pytest.approx(means, abs=1e-3)


def test_streamed_text_equals_non_streamed(engine) -> None:
    @rl.function
    def story(s):
        s += "Once upon a time"
        s += rl.gen("story", max_tokens=16, ignore_eos=True)

    streamed = story.run(backend=engine, stream=True, temperature=0)
    pieces = list(streamed.text_iter("story"))
    whole = story.run(backend=engine, temperature=0)
    assert "".join(pieces) == streamed["story"] == whole["story"]
    assert streamed.get_meta_info("story")["output_ids"] == \
        whole.get_meta_info("story")["output_ids"]


def test_each_turn_hits_the_previous_turn(engine) -> None:
    @rl.function
    def chat(s):
        s += rl.system("You are a test.")
        for i in range(5):
            s += rl.user(f"Question number {i}?")
            s += rl.assistant(rl.gen(f"a{i}", max_tokens=6, ignore_eos=True))

    state = chat.run(backend=engine, temperature=0)
    metas = [state.get_meta_info(f"a{i}") for i in range(5)]
    for before, after in zip(metas, metas[1:], strict=False):
        # All of the previous turn is reused; at most its last sampled token (whose KV
        # the engine has not computed yet) is computed again.
        assert before["session_length"] - 1 <= after["cached_tokens"] <= before["session_length"]
        new = after["prompt_tokens"] - before["session_length"]
        assert after["prompt_tokens"] - after["cached_tokens"] <= new + 1


def test_gen_n_prefills_the_prompt_once(engine) -> None:
    prompt = "1234567890 + 42 = 1234567932. Sessions fork and join; tools are called."

    @rl.function
    def sample(s):
        s += prompt
        s += rl.gen("x", n=4, max_tokens=4, temperature=1.0, ignore_eos=True)

    engine.flush_cache()
    before = engine.stats()
    state = sample.run(backend=engine)
    after = engine.stats()
    metas = state.get_meta_info("x")
    assert len(state["x"]) == 4 and len(metas) == 4
    prompt_len = metas[0]["prompt_tokens"]
    computed = ((after["prompt_tokens_total"] - before["prompt_tokens_total"])
                - (after["cached_tokens_total"] - before["cached_tokens_total"]))
    assert prompt_len > 20
    # Prefilled once (4 separate prompts would compute 4 x prompt_len): branches 1..3 hit
    # branch 0's prefix, recomputing at most their last prompt token for its logits.
    assert prompt_len <= computed <= prompt_len + 3, (computed, prompt_len)


def test_run_batch_overlaps_programs(engine) -> None:
    @rl.function
    def classify(s, text):
        s += rl.user(f"Classify: {text}")
        s += rl.assistant("Label:" + rl.select("label", choices=[" positive", " negative"]))
        s += rl.gen("why", max_tokens=4, ignore_eos=True)

    items = [{"text": f"review number {i}"} for i in range(6)]
    states = classify.run_batch(items, backend=engine, max_concurrency=6, temperature=0)
    assert all(s.error() is None for s in states)
    assert {s["label"] for s in states} <= {" positive", " negative"}
    assert engine.aclient.peak_generating > 1
    assert engine.stats()["sessions"] == 0


def test_cancelling_a_program_leaves_no_session(server) -> None:
    @rl.function
    def long(s):
        s += "Count:"
        forks = s.fork(2)
        forks += rl.gen("side", max_tokens=150, ignore_eos=True)
        s += rl.gen("main", max_tokens=150, ignore_eos=True)

    async def main() -> None:
        async with rl.AsyncClient(server.endpoint) as client:
            with anyio.CancelScope() as scope:
                async with long.astream(backend=client) as state:
                    async for _ in state.text_async_iter("main"):
                        scope.cancel()  # mid-generation
                        break
            stats = await client.stats()
            assert stats["sessions"] == 0 and stats["running"] == 0, stats

    anyio.run(main)


def test_engine_errors_are_typed(engine) -> None:
    @rl.function
    def bad(s):
        s += "x"
        s += rl.gen("y", max_tokens=4, top_p=0.0)

    with pytest.raises(rl.InvalidParamsError) as info:
        bad.run(backend=engine)
    assert info.value.code == "invalid_params"
    with pytest.raises(rl.NotFoundError):
        engine.close_session("no-such-session")
    with pytest.raises(rl.TooLongError):
        engine.generate("x" * 10, max_tokens=10_000)
    assert engine.stats()["sessions"] == 0


def test_seeded_forks_differ_and_rerun_the_same(engine) -> None:
    """fork(3) under one seed: each fork samples with its own derived seed (as branches of
    ``n > 1`` do), so the three differ, and a rerun with that seed repeats them."""

    @rl.function
    def ideas(s):
        s += "Three ideas for a picnic:"
        forks = s.fork(3)
        forks += rl.gen("idea", max_tokens=8, ignore_eos=True)
        return forks

    def run() -> list[str]:
        return [f["idea"] for f in ideas.run(backend=engine, temperature=0.7, seed=0).ret_value]

    first = run()
    assert len(set(first)) == 3 and run() == first


def test_flush_cache_through_runtime_endpoint(server) -> None:
    prompt = "A prompt to be flushed from the prefix cache"
    with rl.RuntimeEndpoint(server.endpoint) as endpoint:
        endpoint.generate(prompt, max_tokens=1)
        assert endpoint.generate(prompt, max_tokens=1).meta_info["cached_tokens"] > 0
        rl.flush_cache(endpoint)
        assert endpoint.generate(prompt, max_tokens=1).meta_info["cached_tokens"] == 0


def test_engine_flush_cache(tiny_model_dir: Path) -> None:
    with rl.Engine(str(tiny_model_dir), device="cpu", dtype="float32", kv_tokens=1024,
                   threads=1, startup_timeout=120) as engine:
        engine.generate("Hello there, engine", max_tokens=1)
        assert engine.generate("Hello there, engine", max_tokens=1).meta_info["cached_tokens"] > 0
        engine.flush_cache()
        assert engine.generate("Hello there, engine", max_tokens=1).meta_info["cached_tokens"] == 0


def test_dead_engine_fails_calls_within_seconds(tiny_model_dir: Path) -> None:
    with rl.Engine(str(tiny_model_dir), device="cpu", dtype="float32", kv_tokens=1024,
                   threads=1, startup_timeout=120) as engine:
        stream = engine.stream("Tell me", max_tokens=250, ignore_eos=True)  # the context (256)
        next(iter(stream))
        os.kill(engine.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(rl.EngineDeadError, match=r"killed by signal 9 \(SIGKILL\)"):
            for _ in stream:
                pass
        with pytest.raises(rl.EngineDeadError):
            engine.generate("again", max_tokens=1)
        assert time.monotonic() - start < 5


def test_engine_does_not_outlive_a_killed_owner(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rl.Engine` starts `radixlm serve --parent-pid <owner>`: SIGKILL the owner (no
    finalizers run) and the server still stops, its children with it."""
    pid_file = tmp_path / "engine.pid"
    owner = (
        "import sys, time, radixlm as rl; "
        f"e = rl.Engine({str(tiny_model_dir)!r}, device='cpu', dtype='float32', "
        "kv_tokens=1024, threads=1, startup_timeout=120); "
        f"open({str(pid_file)!r}, 'w').write(str(e.pid)); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", owner])
    try:
        server_pid = pid_from_file(pid_file, proc, 120, "the owner's engine")
        children = children_of(server_pid)
        assert len(children) == 2, children  # engine + frontend
    finally:
        proc.kill()
        proc.wait()
    wait_until_gone([server_pid, *children], 15, "the engine outlived its killed owner")


def test_engine_keeps_state_only_when_asked(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rl.Engine` runs a server without a state directory unless given `state_dir`."""
    from radixlm.runtime.transport.raw_client import RawClient

    kw = dict(device="cpu", dtype="float32", kv_tokens=1024, threads=1, startup_timeout=120)
    with rl.Engine(str(tiny_model_dir), state_dir=str(tmp_path / "state"), **kw) as engine, \
            RawClient(engine.process.endpoint) as raw:
        assert raw.welcome is not None and raw.welcome.state
    assert list((tmp_path / "state" / "models").iterdir())
    with rl.Engine(str(tiny_model_dir), **kw) as engine, \
            RawClient(engine.process.endpoint) as raw:
        assert raw.welcome is not None and raw.welcome.state == ""
