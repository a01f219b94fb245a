#!/usr/bin/env python3
"""Where a batch-1 decode step's time goes: torch ops dispatched and time per step, for
float32 weights, quantized weights through the per-op path, and quantized weights through
the fused one-call step (`FusedDecode`). The per-op and fused quantized steps do the same
arithmetic with the same kernel, so their difference is the per-op overhead (dispatch,
small-tensor allocation, Python), measured directly.

Runs are interleaved (every configuration once per round) and the 25th percentile of the
pooled per-step times is reported, since other work on a shared machine only adds time.

    .venv/bin/python benchmarks/profile_decode.py [--threads 1] [--dtype gguf] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_model import report  # (benchmarks/ is the script's own directory)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="gguf", help="quantized format to compare with float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).with_name("results_decode_profile.md")))
    p.add_argument("--append", action="store_true")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


class Stepper:
    def __init__(self, model_dir, dtype: str, fused: bool, capacity: int):
        from radixlm.cache import KVPool
        from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner

        c = ModelConfig.from_dir(model_dir)
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, torch.float32, "cpu")
        self.runner = ModelRunner(model_dir, "cpu", dtype, pool, attention="torch")
        if not fused:
            self.runner.fused = None
        self.build = ForwardBatch.build

    def steps(self, prompt: list[int], n: int) -> list[float]:
        self.runner.forward(self.build([(prompt, 0, list(range(len(prompt))))]))
        slots, tok, times = list(range(len(prompt))), 5, []
        for s in range(n):
            slots.append(len(prompt) + s)
            t = time.perf_counter()
            out = self.runner.forward(self.build([([tok], len(prompt) + s, slots)]))
            tok = int(out.argmax(-1)[0])
            times.append(time.perf_counter() - t)
        return times

    def ops_per_step(self, prompt: list[int]) -> float:
        from torch.profiler import ProfilerActivity, profile

        self.steps(prompt, 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.steps(prompt, 1)  # one prefill + one step: subtract a prefill-only run
        with profile(activities=[ProfilerActivity.CPU]) as base:
            self.runner.forward(self.build([(prompt, 0, list(range(len(prompt))))]))
        return _top_level(prof) - _top_level(base)


def _top_level(prof) -> int:
    """Ops called from Python (not those nested inside other ops)."""
    events = prof.events()
    return sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::"))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from radixlm.runtime.model import resolve_model

    model_dir = resolve_model(args.model)
    cap = args.prompt_len + args.steps + 8
    configs = {
        "float32, per op": Stepper(model_dir, "float32", False, cap),
        f"{args.dtype}, per op": Stepper(model_dir, args.dtype, False, cap),
        f"{args.dtype}, fused step": Stepper(model_dir, args.dtype, True, cap),
    }
    prompt = list(range(1000, 1000 + args.prompt_len))
    ops = {name: s.ops_per_step(prompt) for name, s in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for name, s in configs.items():
            times[name] += s.steps(prompt, args.steps)
    load1 = os.getloadavg()
    p25 = {name: float(np.percentile(t, 25)) * 1e3 for name, t in times.items()}
    per_op = p25[f"{args.dtype}, per op"]
    lines = ["| decode step (batch 1) | torch ops from Python per step | ms per step (p25) | tok/s |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for name in configs:
        lines.append(f"| {name} | {ops[name]:.0f} | {p25[name]:.2f} | {1e3 / p25[name]:.1f} |")
    fused = p25[f"{args.dtype}, fused step"]
    info = [
        f"- per-op overhead removed by the fused step: {per_op - fused:.2f} ms per step "
        f"({(per_op - fused) / per_op:.0%} of the per-op step)",
        f"- {args.threads} thread(s); prompt {args.prompt_len} tokens, {args.steps} steps x "
        f"{args.rounds} interleaved rounds; load average {load0[0]:.1f} before, {load1[0]:.1f} after",
    ]
    return report("\n".join(lines + [""] + info), "Batch-1 decode step profile (CPU)", args)


if __name__ == "__main__":
    sys.exit(main())
