#!/usr/bin/env python3
"""Accuracy cost of quantized weights: perplexity on a fixed text and top-1 agreement with
float32, for every weight format on one model, and for the GGUF block types people
download (the same model requantized by llama.cpp's llama-quantize).

- perplexity: the model's own next-token loss over a fixed text (by default
  benchmarks/data/accuracy_text.md: this repository's README.md as of 2026-12-05, the text
  every earlier row was measured on, kept apart so that editing the README no longer moves
  the figures: ~1% of its positions are near ties; up to --max-tokens tokens), one prefill with all logits (a
  prefill's products take int8 activations: kernels/gemm8.c), and its change against the
  float32 reference;
- top-1 agreement on the text: the share of the text's positions whose argmax equals
  float32's (the issue-39 bound for int8 prefill: perplexity within 1%, top-1 >= 98%);
- top-1 agreement over held-out chat prompts (not used anywhere else; short: int16
  activations, as decode), and the share of greedy continuations (--new-tokens each)
  that are token-identical to float32's;
- max logit error relative to the std of float32's logits at that position.
The float32 reference of a GGUF model is its dequantization (what `gguf_convert` makes).
`--requantize Q4_K_M,Q6_K,...` adds a row per type: the model (a GGUF) requantized by
llama-quantize (`--allow-requantize`; Q5_0 / Q5_1 with `--pure`, every tensor that type),
each against its own float32 dequantization.

    .venv/bin/python benchmarks/bench_quant_accuracy.py [--model default] [--out FILE] \
        [--requantize Q4_K_M,Q5_K_M,Q6_K,Q5_0,Q5_1]
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch

PROMPTS = [
    "Explain in two sentences why the sky looks blue during the day.",
    "Write a short poem about a lighthouse keeper who collects old maps.",
    "What are three practical tips for learning a new programming language?",
    "Summarize the plot of a detective story set on a night train.",
    "Give a recipe for a simple vegetable soup with five ingredients.",
    "Why do some metals rust while others do not? Answer briefly.",
    "Describe the rules of chess castling to a beginner.",
    "List four differences between a lake and a pond.",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="default")
    p.add_argument("--formats", default="float32,gguf,int8,int4")
    p.add_argument("--requantize", default="Q4_K_M,Q5_K_M,Q6_K,Q5_0,Q5_1",
                   help="also these types of the model's GGUF, by llama-quantize ('' for none)")
    p.add_argument("--jobs", type=int, default=1, help="parallel jobs if llama-quantize is built")
    p.add_argument("--text", default=str(Path(__file__).resolve().parent / "data" / "accuracy_text.md"))
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).with_name("results_quant.md")))
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


class Model:
    def __init__(self, model_dir: Path, fmt: str, capacity: int):
        from radixlm.cache import KVPool
        from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner

        c = ModelConfig.from_dir(model_dir)
        pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, torch.float32, "cpu")
        self.runner = ModelRunner(model_dir, "cpu", fmt, pool, attention="torch")
        self.build = ForwardBatch.build

    def all_logits(self, ids: list[int]) -> torch.Tensor:
        from radixlm.runtime.model import BatchRequest

        return self.runner.forward(self.build([BatchRequest(ids, 0, list(range(len(ids))), True)]))

    def greedy(self, ids: list[int], n: int) -> list[int]:
        out = [int(self.all_logits(ids)[-1].argmax())]
        slots = list(range(len(ids) + n))
        for s in range(n - 1):
            pos = len(ids) + s
            logits = self.runner.forward(self.build([([out[-1]], pos, slots[: pos + 1])]))
            out.append(int(logits.argmax(-1)[0]))
        return out


def evaluate(model_dir: Path, formats: list[str], text_ids: list[int], prompts: list[list[int]],
             new_tokens: int, label: str = "") -> list[tuple]:
    """A row per format (the first is the reference): (label, format, weights, MB read a
    step, perplexity, its change, top-1 on the text, top-1 on the prompts, identical
    continuations, max logit error / std)."""
    cap = max(len(text_ids), max(map(len, prompts)) + new_tokens) + 8
    ref = None
    rows = []
    for fmt in formats:
        m = Model(model_dir, fmt, cap)
        logits = m.all_logits(text_ids)
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text_ids[1:]))
        per_prompt = [m.all_logits(p) for p in prompts]
        conts = [m.greedy(p, new_tokens) for p in prompts]
        ppl = math.exp(float(nll))
        if ref is None:
            ref = (per_prompt, conts, logits.argmax(-1), ppl)
        text_top1 = float((logits.argmax(-1) == ref[2]).float().mean())
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(per_prompt, ref[0], strict=True))
        total = sum(a.shape[0] for a in per_prompt)
        same = sum(int(a == b) for a, b in zip(conts, ref[1], strict=True))
        err = max(float(((a - b).abs().amax(-1) / b.std(-1)).max()) for a, b in zip(per_prompt, ref[0], strict=True))
        rows.append((label, fmt, m.runner.model.weight_format, m.runner.model.weight_bytes() / 1e6, ppl,
                     ppl / ref[3] - 1, text_top1, agree / total, same, err))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def requantized_models(model_dir: Path, types: list[str], jobs: int) -> dict[str, Path]:
    """The model's GGUF requantized to each of `types` by llama-quantize, converted."""
    from bench_peer import ensure_llama_server, peer_dir  # (benchmarks/ is this script's directory)
    from radixlm.runtime.model import resolve_model
    from radixlm.runtime.model.gguf_weights import source_gguf
    from random_gguf import requantized

    src = source_gguf(model_dir)
    if src is None:
        sys.exit("--requantize needs a GGUF model")
    binary = ensure_llama_server(peer_dir(), jobs, "llama-quantize")
    out = {}
    for qtype in types:
        pure = qtype in ("Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0")
        path = requantized(src, qtype, binary, peer_dir(), pure=pure)
        out[qtype] = resolve_model(str(path), progress=False)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from radixlm.runtime.model import resolve_model
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text_ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))[: args.max_tokens]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in PROMPTS
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    from radixlm.runtime.model.gguf_weights import source_gguf

    src = source_gguf(model_dir)
    rows = evaluate(model_dir, args.formats.split(","), text_ids, prompts, args.new_tokens,
                    src.name if src else model_dir.name)  # fmt: skip
    types = [t for t in args.requantize.split(",") if t]
    for qtype, qdir in (requantized_models(model_dir, types, args.jobs) if types else {}).items():
        rows += evaluate(qdir, ["float32", "gguf"], text_ids, prompts, args.new_tokens, qtype)
    lines = [
        "| file | --dtype | weights | MB read per step | perplexity | vs float32 | top-1 agreement with float32 on the text (int8 prefill) | top-1 on the prompts | greedy continuations identical | max logit error / std |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for label, fmt, wf, mb, ppl, dppl, text_top1, agree, same, err in rows:
        lines.append(f"| {label} | {fmt} | {wf} | {mb:.0f} | {ppl:.3f} | {dppl:+.2%} | {text_top1:.2%} | "
                     f"{agree:.2%} | {same}/{len(prompts)} | {err:.3f} |")  # fmt: skip
    info = [
        f"- model: `{model_dir.name}`; fixed text: `{Path(args.text).name}`, {len(text_ids)} tokens; "
        f"{len(prompts)} held-out chat prompts, {sum(map(len, prompts))} prompt positions, greedy "
        f"continuations of {args.new_tokens} tokens",
        "- the float32 reference of each file is its own dequantization (so `gguf` computes the "
        "same function up to its activations' rounding: int8 on the text, int16 on the short "
        "prompts; `int4` re-quantizes to the file's own Q4_1 grid); other files: the model "
        "requantized by llama.cpp's llama-quantize (`--allow-requantize`, Q5_0 / Q5_1 `--pure`)",
        "- target (issue 39, int8 prefill): perplexity within 1% of float32, top-1 on the text >= 98%",
    ]
    text = "\n".join(lines + [""] + info)
    print(text)
    if not args.no_write:
        cmd = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
        Path(args.out).write_text(
            f"# Accuracy of quantized weights\n\nCommand: `{cmd}`\n\nRun: "
            f"{time.strftime('%Y-%m-%d %H:%M')}\n\n{text}\n", encoding="utf-8")  # fmt: skip
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
