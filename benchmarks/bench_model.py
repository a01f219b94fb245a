#!/usr/bin/env python3
"""Model-runner throughput on SmolLM2 (or any supported model), beside HF transformers.

Measures, in one process, on the same weights and thread count:
- prefill of N tokens (default 1,024): ours vs HF forward (logits of the last token only);
- decode at batch 1: ours (greedy loop through ModelRunner) vs HF `generate` (decode part:
  time of N+1 new tokens minus time of 1), with weight bytes read per step ÷ step time as
  the bandwidth achieved, beside the machine's copy bandwidth (large tensor copy);
- decode at batch 16 and 64 (ours): aggregate tokens/s; the requests share one cached
  prompt (prefix-cache style) and each decodes into its own slots.
Prints a table with a target-met column and writes it (plus the command) to
benchmarks/results_model.md (--out to change, --no-write to skip).

Targets: prefill >= 1.0x HF; batch-1 decode >= 1.2x HF; batch-64 aggregate >= 8x our batch 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from radixlm.cache.pages import align_up


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="default", help="'default' (SmolLM2 GGUF), a .gguf or an HF dir"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", default="float32",
                   help="ours: float32, or quantized weights int8 / int4 / gguf (HF stays float32)")
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128, help="context before decode steps")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batch-steps", type=int, default=8, help="decode steps at batch 16/64")
    p.add_argument("--batches", default="16,64", help="comma-separated decode batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="rounds per measurement (prefill: best of; decode: pooled steps)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--skip-hf", action="store_true", help="measure ours only")
    p.add_argument("--out", default=str(Path(__file__).with_name("results_model.md")))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time, which on a machine "
                        "shared with other work estimates the unloaded figures (use with "
                        "--threads 1)")
    p.add_argument("--append", action="store_true", help="append to --out instead of replacing")
    return p.parse_args(argv)


now = time.perf_counter  # --clock cpu: time.process_time (this process's CPU time)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = now()
        fn()
        times.append(now() - t)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 512 MiB tensor copy (best of 7), counting bytes read + written."""
    x = torch.ones(128 * 1024 * 1024)
    y = torch.empty_like(x)
    y.copy_(x)
    t = min(median_time(lambda: y.copy_(x), 1) for _ in range(7))  # best: the machine's figure
    return 2 * x.numel() * x.element_size() / t / 1e9


class Ours:
    def __init__(self, model_dir: Path, capacity: int, page_size: int, dtype: str):
        from radixlm.cache import KVPool
        from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner

        self.ForwardBatch = ForwardBatch
        c = ModelConfig.from_dir(model_dir)
        cap = align_up(capacity, page_size)
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, cap, page_size,
                           torch.float32, "cpu")  # fmt: skip
        self.runner = ModelRunner(model_dir, "cpu", dtype, self.pool, attention="torch")
        self.config = c

    def prefill(self, ids: list[int]) -> torch.Tensor:
        return self.runner.forward(self.ForwardBatch.build([(ids, 0, list(range(len(ids))))]))

    def decode(self, prompt: list[int], steps: int, batch: int) -> list[float]:
        """Per-step seconds of `steps` greedy decode steps (batch build + forward + argmax)
        of `batch` requests sharing the cached `prompt`."""
        n = len(prompt)
        logits = self.prefill(prompt)
        base = n
        slots = [list(range(n)) for _ in range(batch)]
        toks = [int(logits.argmax(-1)[0])] * batch
        times = []
        for s in range(steps):
            t = now()
            reqs = []
            for b in range(batch):
                slots[b].append(base + b * steps + s)
                reqs.append(([toks[b]], n + s, slots[b]))
            logits = self.runner.forward(self.ForwardBatch.build(reqs))
            toks = logits.argmax(-1).tolist()
            times.append(now() - t)
        return times


class HF:
    def __init__(self, model_dir: Path):
        import transformers
        from radixlm.runtime.model import ensure_dense_weights

        # a converted GGUF holds no weights: transformers reads float32 written on demand
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(ensure_dense_weights(model_dir) if (model_dir / "radixlm_source.json").exists()
                else model_dir), dtype=torch.float32,
        ).eval()

    def prefill(self, ids: list[int]):
        with torch.inference_mode():
            return self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits

    def decode(self, prompt: list[int], steps: int) -> list[float]:
        """Per-step seconds of HF `generate` decode steps: the intervals between calls of a
        logits processor, which `generate` runs once per new token (after prefill)."""
        from transformers import LogitsProcessorList

        stamps: list[float] = []

        def stamp(input_ids, scores):
            stamps.append(now())
            return scores

        with torch.inference_mode():
            self.model.generate(
                torch.tensor([prompt]), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([stamp]),
            )  # fmt: skip
        return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def robust(times: list[float]) -> float:
    """25th percentile: the other sessions on a shared machine only ever add time."""
    return float(np.percentile(times, 25))


def main(argv=None) -> int:
    global now
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        now = time.process_time
        if torch.get_num_threads() != 1:
            print("warning: --clock cpu sums the CPU time of all threads; use --threads 1")
    from radixlm.runtime.model import resolve_model

    torch.manual_seed(0)
    model_dir = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",") if b]
    load0 = os.getloadavg()
    bw = copy_bandwidth()
    cap = (
        max(
            args.prefill_len,
            args.prompt_len + max(batches + [1]) * max(args.decode_steps, args.batch_steps),
        )
        + 64
    )
    ours = Ours(model_dir, cap, args.page_size, args.dtype)
    hf = None if args.skip_hf else HF(model_dir)
    vocab = ours.config.vocab_size
    prefill_ids = torch.randint(100, vocab, (args.prefill_len,)).tolist()
    prompt = torch.randint(100, vocab, (args.prompt_len,)).tolist()
    rows = []

    # prefill: ours and HF interleaved, best of `repeats` each
    ours.prefill(prefill_ids)
    if hf:
        hf.prefill(prefill_ids)
    t_ours, t_hf = [], []
    for _ in range(args.repeats):
        t_ours.append(median_time(lambda: ours.prefill(prefill_ids), 1))
        if hf:
            t_hf.append(median_time(lambda: hf.prefill(prefill_ids), 1))
    p_ours = args.prefill_len / min(t_ours)
    p_hf = args.prefill_len / min(t_hf) if hf else None
    rows.append((f"prefill {args.prefill_len} tok", p_ours, p_hf, "ours >= 1.0x HF",
                 None if p_hf is None else p_ours / p_hf >= 1.0, p_hf and p_ours / p_hf))  # fmt: skip

    # decode: per-step times of batch 1 (ours and HF) and of the larger batches, in rounds
    # that interleave them all, so that each figure (and the batch-64 / batch-1 ratio) sees
    # the same machine load: on a shared machine the load drifts over a run, and it slows
    # compute-bound batched steps and bandwidth-bound batch-1 steps by different amounts.
    ours.decode(prompt, 2, 1)
    if hf:
        hf.decode(prompt, 2)
    for b in batches:
        ours.decode(prompt, 1, b)
    s_ours, s_hf = [], []
    s_batch: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):
        s_ours += ours.decode(prompt, args.decode_steps, 1)
        if hf:
            s_hf += hf.decode(prompt, args.decode_steps)
        for b in batches:
            s_batch[b] += ours.decode(prompt, args.batch_steps, b)
    d_ours = 1 / robust(s_ours)
    d_hf = 1 / robust(s_hf) if hf else None
    rows.append(("decode batch 1", d_ours, d_hf, "ours >= 1.2x HF",
                 None if d_hf is None else d_ours / d_hf >= 1.2, d_hf and d_ours / d_hf))  # fmt: skip
    weight_bytes = ours.runner.model.weight_bytes()
    achieved = weight_bytes * d_ours / 1e9
    for b in batches:
        agg = b / robust(s_batch[b])
        target = "ours >= 8x our batch 1" if b == 64 else "(info)"
        met = agg / d_ours >= 8 if b == 64 else None
        rows.append((f"decode batch {b} (aggregate)", agg, None, target, met, agg / d_ours))
    load1 = os.getloadavg()

    lines = []
    lines.append("| measurement | ours tok/s | HF tok/s | ratio | target | met |")
    lines.append("|---|---:|---:|---:|---|---|")
    for name, o, h, target, met, ratio in rows:
        hs = f"{h:,.1f}" if h else "-"
        rs = f"{ratio:.2f}x" if ratio else "-"
        ms = "-" if met is None else ("yes" if met else "NO")
        lines.append(f"| {name} | {o:,.1f} | {hs} | {rs} | {target} | {ms} |")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    info = [
        f"- model: `{model_dir}` ({ours.config.num_layers} layers, hidden {ours.config.hidden_size}); ours: "
        f"`--dtype {args.dtype}` (weights {ours.runner.model.weight_format}), HF: float32",
        f"- clock: {args.clock} ({'elapsed time' if args.clock == 'wall' else 'process CPU time'})",
        f"- machine: {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load0[0]:.1f} before, {load1[0]:.1f} after",
        f"- memory bandwidth (512 MiB copy, read+write): {bw:.1f} GB/s",
        f"- batch-1 decode: {weight_bytes / 1e6:.0f} MB of weights per step / {1e3 / d_ours:.1f} ms "
        f"per step = {achieved:.1f} GB/s achieved ({achieved / bw:.0%} of the copy bandwidth)",
        f"- prefill {args.prefill_len} tokens; decode after a {args.prompt_len}-token prompt, "
        f"{args.decode_steps} steps at batch 1, {args.batch_steps} at larger batches, in "
        f"{args.repeats} rounds (batch 1, HF, larger batches interleaved); prefill: best of "
        f"{args.repeats} (ours and HF interleaved); decode: "
        f"25th percentile of per-step times (HF's from a per-token logits-processor stamp); "
        f"median-based batch-1 ratio: {statistics.median(s_hf) / statistics.median(s_ours) if hf else 0:.2f}x",
    ]
    return report("\n".join(lines + [""] + info), "Model benchmark (CPU)", args)


def report(text: str, title: str, args: argparse.Namespace) -> int:
    """Print `text`; unless --no-write, write it to --out (appended with --append)."""
    print(text)
    if not args.no_write:
        write_results(Path(args.out), title, text, args.append)
    return 0


def write_results(out: Path, title: str, text: str, append: bool) -> None:
    """`text` under this run's command and time, replacing `out` (a `# title` file) or
    appended to it."""
    cmd = " ".join(shlex.quote(a) for a in [sys.executable.split("/")[-1], *sys.argv])
    section = f"Command: `{cmd}`\n\nRun: {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n{text}\n"
    if append and out.exists():
        out.write_text(out.read_text(encoding="utf-8") + "\n" + section, encoding="utf-8")
    else:
        out.write_text(f"# {title}\n\n" + section, encoding="utf-8")
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    sys.exit(main())
