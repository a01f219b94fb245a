#!/usr/bin/env python3
"""Batched decode: a GGUF's blocks as stored (`--dtype gguf`) against float32 weights on the
same model, one decode step of B requests at a time, B = 1 .. max running (64).

Each request has a context of its own (`--context` tokens, prefilled once), so attention
reads B different histories, as in a busy engine; each format runs over the KV pool the
engine would give it (gguf: float16 rows, float32 weights: float32 rows). Formats are
interleaved per round and per batch size, and the median step time is reported (other
work on a shared machine only adds time); aggregate tok/s = B / step time.

    .venv/bin/python benchmarks/bench_batch_decode.py [--threads 2] [--model default]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,2,4,8,16,32,48,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="decode steps per batch and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--formats", default="gguf,float32")
    p.add_argument("--out", default=str(Path(__file__).with_name("results_batch_decode.md")))
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


class Side:
    """One weight format over its own pool, with `max_b` prefilled contexts."""

    def __init__(self, model_dir: Path, fmt: str, max_b: int, context: int, steps: int, rounds: int):
        from radixlm.cache import KVPool
        from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner
        from radixlm.runtime.model.runner import resolve_kv_dtype

        c = ModelConfig.from_dir(model_dir)
        kv = resolve_kv_dtype("auto", "cpu", torch.float32, quantized=fmt != "float32")
        self.per = context + steps * rounds * 2 + 2
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, max_b * self.per, 1, kv, "cpu")
        self.runner = ModelRunner(model_dir, "cpu", fmt, pool, attention="torch")
        self.build, self.context, self.kv = ForwardBatch.build, context, kv
        g = torch.Generator().manual_seed(0)
        for b in range(max_b):
            ids = torch.randint(100, c.vocab_size - 100, (context,), generator=g).tolist()
            self.runner.forward(self.build([(ids, 0, self._slots(b, context))]))
        self.pos = [context] * max_b

    def _slots(self, b: int, n: int) -> list[int]:
        return list(range(b * self.per, b * self.per + n))

    def steps(self, batch: int, n: int) -> list[float]:
        times = []
        for _ in range(n):
            reqs = [([5 + b], self.pos[b], self._slots(b, self.pos[b] + 1)) for b in range(batch)]
            t = time.perf_counter()
            self.runner.forward(self.build(reqs))
            times.append(time.perf_counter() - t)
            for b in range(batch):
                self.pos[b] += 1
        for b in range(batch):  # the next batch size decodes from the same contexts
            self.pos[b] -= n
        return times


def main(argv=None) -> int:
    args = parse_args(argv)
    from radixlm.runtime.model import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    formats = args.formats.split(",")
    load0 = os.getloadavg()
    sides = {f: Side(model_dir, f, max(batches), args.context, args.steps, args.rounds) for f in formats}
    times: dict[tuple[str, int], list[float]] = {(f, b): [] for f in formats for b in batches}
    for rnd in range(args.rounds):
        for b in batches:
            order = formats if rnd % 2 == 0 else formats[::-1]
            for f in order:
                times[(f, b)] += sides[f].steps(b, args.steps)
        print(f"round {rnd} done", flush=True)
    load1 = os.getloadavg()
    head = "| batch | " + " | ".join(f"{f} ms/step | {f} tok/s" for f in formats)
    if len(formats) == 2:
        head += f" | {formats[0]} ÷ {formats[1]} (tok/s)"
    lines = [head + " |", "|---:|" + "---:|" * (2 * len(formats) + (len(formats) == 2))]
    for b in batches:
        med = {f: statistics.median(times[(f, b)]) for f in formats}
        row = f"| {b} | " + " | ".join(f"{med[f] * 1e3:.1f} | {b / med[f]:.1f}" for f in formats)
        if len(formats) == 2:
            row += f" | {med[formats[1]] / med[formats[0]]:.2f}x"
        lines.append(row + " |")
    cmd = " ".join(["python", *sys.argv])
    info = [
        f"- model: `{model_dir.name}`; weights " + ", ".join(
            f"{f}: {sides[f].runner.model.weight_format} over {str(sides[f].kv).removeprefix('torch.')} KV"
            for f in formats),
        f"- {args.context}-token contexts of their own per request; {args.steps} steps x "
        f"{args.rounds} rounds per batch size and format, interleaved; median step",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads; load average {load0[0]:.1f} before, {load1[0]:.1f} after",
    ]  # fmt: skip
    text = "\n".join([f"Command: `{cmd}`", "", f"Run: {time.strftime('%Y-%m-%d %H:%M')}", "",
                      *lines, "", *info])  # fmt: skip
    print(text)
    if not args.no_write:
        Path(args.out).write_text(f"# Batched decode: gguf vs float32 weights\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
