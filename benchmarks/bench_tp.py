#!/usr/bin/env python3
"""Tensor parallelism vs one rank: prefill and batch-1 decode tokens/s through the runner.

TP=1 is `ModelRunner` with `--threads` torch threads; TP=N is `TensorParallel` with
`--threads // N` threads on each rank (the same cores in all), rank 0 in this process.
Rounds alternate TP=1 and TP=N (interleaved A/B, so load from other work hits both);
each figure is the median over rounds. Weights are float32 (TP runs dense weights).

    python benchmarks/bench_tp.py --model tiny --tp 2
    python benchmarks/bench_tp.py --model default --tp 3   # SmolLM2: 9 heads, 3 KV heads

On a CPU, ranks on separate cores of one socket share its memory bandwidth, and each
step adds 2 all-reduces per layer plus a pipe message: expect TP to be slower there; it
pays where one device cannot hold the model or its bandwidth is per device (GPUs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from radixlm.cache import KVPool
from radixlm.runtime.distributed import TensorParallel
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner, resolve_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (random, tests/tiny_models.py), "
                                                   "'default' (SmolLM2) or an HF directory")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads over all ranks")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


def model_dir(spec: str, tmp: str) -> Path:
    if spec == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny_models import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp, "llama", with_tokenizer=False)
    return resolve_model(spec)


def measure(runner, prompt_len: int, steps: int, vocab: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s at batch 1) for one prompt and `steps` tokens."""
    ids = [(7 * i) % (vocab - 3) + 3 for i in range(prompt_len)]
    t0 = time.perf_counter()
    tok = int(runner.forward(ForwardBatch.build([(ids, None, range(prompt_len))]))[-1].argmax())
    prefill = prompt_len / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(steps):
        n = prompt_len + i + 1
        tok = int(runner.forward(ForwardBatch.build([([tok], None, range(n))]))[-1].argmax())
    return prefill, steps / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        path = model_dir(args.model, tmp)
        c = ModelConfig.from_dir(path)
        capacity = args.prompt_len + args.decode_steps + 8
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, torch.float32, "cpu")
        one = ModelRunner(path, "cpu", torch.float32, pool, attention="torch")
        per_rank = max(1, args.threads // args.tp)
        tp = TensorParallel.start(path, args.tp, device=torch.device("cpu"), dtype=torch.float32,
                                  capacity=capacity, page_size=1, attention="torch",
                                  threads=per_rank)  # fmt: skip
        results: dict[str, list[tuple[float, float]]] = {"1": [], str(args.tp): []}
        try:
            for _ in range(args.rounds):
                torch.set_num_threads(args.threads)
                results["1"].append(measure(one, args.prompt_len, args.decode_steps, c.vocab_size))
                torch.set_num_threads(per_rank)
                results[str(args.tp)].append(
                    measure(tp.runner, args.prompt_len, args.decode_steps, c.vocab_size))
        finally:
            tp.close()
    print(f"model {args.model} ({c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads} "
          f"heads / {c.num_kv_heads} KV), float32, {args.threads} threads in all, "
          f"median of {args.rounds} interleaved rounds")
    print("| TP | threads per rank | prefill tok/s | decode tok/s (batch 1) |")
    print("|---:|---:|---:|---:|")
    for tp_size, rows in results.items():
        pre = statistics.median(r[0] for r in rows)
        dec = statistics.median(r[1] for r in rows)
        threads = args.threads if tp_size == "1" else per_rank
        print(f"| {tp_size} | {threads} | {pre:,.0f} | {dec:,.1f} |")


if __name__ == "__main__":
    main()
