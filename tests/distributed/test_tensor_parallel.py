"""Tensor parallelism (runtime/distributed/) on CPU with gloo, tiny random checkpoints.

The reference is HF transformers (logits and greedy tokens of the full prompt, no cache)
and the same model at TP=1: TP=2 must give the same greedy tokens and logits within
float32 tolerance, through the runner, and end to end through `radixlm serve --tp 2` with
sessions and forks. A worker that dies fails the engine with an error naming it; sizes
that do not divide the model's heads are refused at start-up, in one line.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from conftest import ServerHandle, assert_pool_clean, children_of, process_alive, start_test_server
from radixlm.cache import KVPool
from radixlm.runtime import protocol as wire
from radixlm.runtime.distributed import (
    TensorParallel,
    TensorParallelConfigError,
    TensorParallelError,
    check_tp_size,
)
from radixlm.runtime.distributed.load import check_dense
from radixlm.runtime.distributed.workers import join_process
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner
from radixlm.runtime.transport.errors import EngineError
from tiny_models import FAMILY_VARIANTS, MOE_VARIANTS, TINY_VARIANTS, make_tiny_checkpoint

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]
CAPACITY = 512
LOGIT_TOL = 1e-4  # float32, random tiny model with logits of magnitude ~5


def _hf(model_dir: Path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf.eval()


@torch.no_grad()
def hf_greedy(hf, prompt: Sequence[int], n: int) -> list[int]:
    ids = list(map(int, prompt))
    out = []
    for _ in range(n):
        tok = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


# ----------------------------------------------------------------------------- sizes


def test_sizes_that_do_not_divide_the_heads_are_refused(tiny_model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)  # 4 heads, 2 KV heads, intermediate 96
    check_tp_size(cfg, 2)
    with pytest.raises(TensorParallelConfigError, match="num_key_value_heads=2") as e:
        check_tp_size(cfg, 4)
    assert "num_attention_heads" not in str(e.value).split("does not divide")[1]
    with pytest.raises(TensorParallelConfigError, match="does not divide num_attention_heads=4"):
        check_tp_size(cfg, 3)


@pytest.mark.parametrize(("dtype", "quantize"), [("gguf", "none"), ("float32", "int8"),
                                                 ("int4", "none")])
def test_quantized_weights_are_refused(dtype: str, quantize: str) -> None:
    with pytest.raises(TensorParallelConfigError, match="dense weights"):
        check_dense(dtype, quantize, 2)


def test_serve_with_a_size_that_does_not_divide_is_one_line(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    proc = subprocess.run(
        [*CLI, "serve", "-m", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
         "--no-http", "--endpoint", f"ipc://{tmp_path}/s", "--tp", "3"],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--tensor-parallel-size 3 must divide" in lines[0], lines[0]
    assert "num_attention_heads=4" in lines[0], lines[0]


# ---------------------------------------------------------------------------- runner


@pytest.fixture(scope="module",
                params=["llama-linear-rope-bias", "qwen3", "qwen2_moe", "mixtral", "gemma3"])
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GQA (4 heads, 2 KV heads) with q/k/v, o, gate/up and down biases; Qwen3's
    per-head q/k norms with an explicit head_dim; mixtures of experts (Qwen2-MoE's
    shared expert; Mixtral), each rank holding a slice of every expert; and Gemma 3's
    sandwich norms (summed over the ranks before they normalise), sliding windows and two
    RoPE bases."""
    kw = {**TINY_VARIANTS, **MOE_VARIANTS, **FAMILY_VARIANTS}[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp"), **kw)


def _pool(model_dir: Path) -> KVPool:
    c = ModelConfig.from_dir(model_dir)
    return KVPool(c.num_layers, c.num_kv_heads, c.head_dim, CAPACITY, 1, torch.float32, "cpu")


@pytest.fixture(scope="module")
def tp2(variant_dir: Path) -> Iterator[TensorParallel]:
    tp = TensorParallel.start(variant_dir, 2, device=torch.device("cpu"), dtype=torch.float32,
                              capacity=CAPACITY, page_size=1, attention="torch", threads=1)  # fmt: skip
    yield tp
    tp.close()
    assert not any(w.process.is_alive() for w in tp.workers)


def test_each_rank_holds_its_share_of_heads_and_kv_heads(tp2: TensorParallel,
                                                         variant_dir: Path) -> None:
    full = ModelConfig.from_dir(variant_dir)
    local = tp2.runner.config
    assert (local.num_heads, local.num_kv_heads) == (full.num_heads // 2, full.num_kv_heads // 2)
    assert tuple(tp2.runner.pool.k[0].shape) == (CAPACITY, full.num_kv_heads // 2, full.head_dim)


def test_tp2_logits_match_tp1_and_transformers(tp2: TensorParallel, variant_dir: Path) -> None:
    """A ragged step (two prompts), then one on a cached prefix and decode steps."""
    ref = ModelRunner(variant_dir, "cpu", torch.float32, _pool(variant_dir), attention="torch")
    hf = _hf(variant_dir)
    rng = random.Random(1)
    a = [rng.randrange(3, 400) for _ in range(23)]
    b = [rng.randrange(3, 400) for _ in range(9)]
    steps = [
        [(a[:17], None, range(0, 17), True), (b, None, range(100, 109))],
        [(a[17:], None, [*range(0, 17), *range(200, 206)], True)],  # on a's cached prefix
        [([a[0]], None, [*range(100, 109), 300])],  # decode after b
    ]
    for requests in steps:
        want = ref.forward(ForwardBatch.build(requests))
        got = tp2.runner.forward(ForwardBatch.build(requests))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=LOGIT_TOL, rtol=0)
    with torch.no_grad():
        hf_a = hf(torch.tensor([a])).logits[0]
        hf_b = hf(torch.tensor([[*b, a[0]]])).logits[0, -1]
    torch.testing.assert_close(got[0], hf_b, atol=LOGIT_TOL, rtol=0)
    second = tp2.runner.forward(ForwardBatch.build([(a[17:], None, [*range(0, 17),
                                                     *range(200, 206)], True)]))  # fmt: skip
    torch.testing.assert_close(second, hf_a[17:], atol=LOGIT_TOL, rtol=0)


def test_tp2_greedy_tokens_equal_tp1_and_transformers(tp2: TensorParallel,
                                                      variant_dir: Path) -> None:
    ref = ModelRunner(variant_dir, "cpu", torch.float32, _pool(variant_dir), attention="torch")
    prompt = [1, 17, 42, 99, 5, 250, 31, 7]
    n = 12
    want = hf_greedy(_hf(variant_dir), prompt, n)
    for runner in (ref, tp2.runner):
        ids, out = list(prompt), []
        batch = ForwardBatch.build([(ids, None, range(len(ids)))])
        for _ in range(n):
            tok = int(runner.forward(batch)[-1].argmax())
            out.append(tok)
            ids.append(tok)
            batch = ForwardBatch.build([([tok], None, range(len(ids)))])
        assert out == want


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-serve"), "llama", seed=5)


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory, tp_model_dir: Path) -> Iterator[ServerHandle]:
    with start_test_server(tmp_path_factory.mktemp("tp-server"), tp_model_dir, "--tp", "2") as h:
        engine = [p for p in h.child_pids if "server.child engine " in _cmdline(p)]
        helpers = children_of(engine[0])
        assert any("spawn_main" in _cmdline(p) for p in helpers)
        yield h
    assert h.process.returncode == 0, h.log()
    deadline = time.monotonic() + 10  # the worker rank stops with the engine
    while any(process_alive(p) for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(p) for p in helpers), h.log()


def _greedy(**kw: object) -> dict[str, object]:
    return dict(max_tokens=6, temperature=0.0, ignore_eos=True, **kw)


def test_a_session_turn_and_a_fork_through_serve_tp2(tp_server: ServerHandle,
                                                     tp_model_dir: Path) -> None:
    hf = _hf(tp_model_dir)
    rng = random.Random(7)
    first = [rng.randrange(3, 400) for _ in range(30)]
    with tp_server.client(timeout_s=120) as c:
        opened = c.call(wire.OpenSession(rid=c.new_rid(), input=wire.Input(input_ids=first)))
        assert isinstance(opened, wire.SessionOpened) and opened.length == len(first)
        sid = opened.session
        turn = [rng.randrange(3, 400) for _ in range(5)]
        done = c.generate(wire.Input(input_ids=turn), session=sid, **_greedy())
        history = first + turn
        assert done.token_ids == hf_greedy(hf, history, 6)
        assert done.usage.cached_tokens == len(first)  # the turn hit the session's history
        history += done.token_ids
        forked = c.call(wire.ForkSession(rid=c.new_rid(), session=sid, n=2))
        assert isinstance(forked, wire.SessionsForked) and len(forked.sessions) == 2
        for branch in forked.sessions:
            more = [rng.randrange(3, 400) for _ in range(4)]
            d = c.generate(wire.Input(input_ids=more), session=branch, **_greedy())
            assert d.token_ids == hf_greedy(hf, history + more, 6)
            assert d.usage.cached_tokens >= len(history) - 1
        stats = assert_pool_clean(c)
        assert stats.protected >= len(history)  # the sessions stay held on rank 0's cache
    assert "tensor parallel: 2 ranks (gloo)" in tp_server.log()


def test_a_killed_worker_fails_the_engine_with_its_name(tmp_path: Path,
                                                        tp_model_dir: Path) -> None:
    with start_test_server(tmp_path / "srv", tp_model_dir, "--tp", "2") as h:
        with h.client(timeout_s=60) as c:
            assert len(c.generate(wire.Input(input_ids=[5, 6, 7]), **_greedy()).token_ids) == 6
        engine = [p for p in h.child_pids if "server.child engine " in _cmdline(p)]
        assert len(engine) == 1, [_cmdline(p) for p in h.child_pids]
        helpers = children_of(engine[0])  # the worker rank and multiprocessing's tracker
        workers = [p for p in helpers if "spawn_main" in _cmdline(p)]
        assert len(workers) == 1, [_cmdline(p) for p in helpers]
        os.kill(workers[0], signal.SIGKILL)
        # The engine stops, naming the rank (no hang); `radixlm serve` starts it again
        # (runtime/server/supervise.py), with ranks of its own, and serves on.
        deadline = time.monotonic() + 120
        while "the engine process exited with code 1; starting it again" not in h.log():
            assert h.process.poll() is None, h.log()
            assert time.monotonic() < deadline, h.log()
            time.sleep(0.1)
        log = h.log()
        assert f"tensor-parallel rank 1 (pid {workers[0]}) stopped (signal 9)" in log, log
        while any(process_alive(p) for p in [*engine, *helpers]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(p) for p in [*engine, *helpers])
        while True:
            try:
                with h.client(timeout_s=60) as c:
                    out = c.generate(wire.Input(input_ids=[5, 6, 7]), **_greedy())
                break
            except EngineError:
                assert time.monotonic() < deadline, h.log()
                time.sleep(0.2)
        assert len(out.token_ids) == 6


def test_a_failed_collective_fails_the_forward_with_the_workers_error(tp_model_dir: Path) -> None:
    """In process: a worker killed under a running engine's next forward; the forward
    raises `TensorParallelError` naming the rank and the failure callback fires."""
    tp = TensorParallel.start(tp_model_dir, 2, device=torch.device("cpu"), dtype=torch.float32,
                              capacity=CAPACITY, page_size=1, threads=1)  # fmt: skip
    fired: list[bool] = []
    try:
        tp.on_failure(lambda: fired.append(True))
        batch = ForwardBatch.build([([5, 6, 7], None, range(3))])
        tp.runner.forward(batch)
        pid = tp.workers[0].process.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) stopped \(signal 9\)"):
            tp.runner.forward(ForwardBatch.build([([8], None, range(4))]))
        assert fired == [True]
        with pytest.raises(TensorParallelError):  # and every later one, at once
            tp.runner.forward(ForwardBatch.build([([9], None, range(5))]))
    finally:
        tp.close()


def test_an_error_in_a_worker_reaches_the_log_and_fails_the_engine(
        tp_model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A worker that raises (here: a step message it cannot read) logs its traceback to
    the engine's stderr and reports the error, which every later forward raises."""
    tp = TensorParallel.start(tp_model_dir, 2, device=torch.device("cpu"), dtype=torch.float32,
                              capacity=CAPACITY, page_size=1, threads=1)  # fmt: skip
    fired: list[bool] = []
    try:
        tp.on_failure(lambda: fired.append(True))
        tp.workers[0].conn.send_bytes(bytes(48))  # op 0: no such step
        # the engine's failure watcher joins the same process: join_process, not join
        assert join_process(tp.workers[0].process, 60) == 1
        deadline = time.monotonic() + 10
        while not fired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fired == [True]
        expected = r"rank 1 \(pid \d+\) stopped \(exit code 1\): ValueError: unknown tensor-parallel step op 0"
        with pytest.raises(TensorParallelError, match=expected):
            tp.runner.forward(ForwardBatch.build([([5, 6, 7], None, range(3))]))
    finally:
        tp.close()
    err = capfd.readouterr().err
    assert "radixlm-tp1 ERROR radixlm.tp: tensor-parallel rank 1 failed" in err, err
    assert "Traceback" in err and "unknown tensor-parallel step op 0" in err, err


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
