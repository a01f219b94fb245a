#!/usr/bin/env python3
"""Offline throughput on a GPU: a random-weight model of Qwen3-0.6B's shape, continuous
batching over ModelRunner + a paged KV pool, greedy decoding with ignore_eos.

Workload (defaults): 256 requests, input and output lengths uniform in 100..1024, all
submitted at t=0. The loop is a minimal scheduler: admit waiting requests (whole KV
reservation, prompt tokens within a prefill budget) and prefill them in one batch, then run
one decode step for every running request; finished requests free their pages.

Writes a markdown summary and a JSON record (to --out-dir, default $OUT or ".").
Needs CUDA; the attention backend defaults to flashinfer (--attention torch to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from radixlm.cache.pages import div_ceil

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention", default="flashinfer", choices=["flashinfer", "torch", "auto"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--mem-fraction", type=float, default=0.6, help="of free memory for KV")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=int, default=None, help="override (quick runs)")
    p.add_argument("--device", default="cuda", help="cpu only for a smoke run of the loop")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--tag", default="gpu_throughput")
    return p.parse_args(argv)


def random_model(config: dict, device, dtype):
    from radixlm.runtime.model import DecoderModel, ModelConfig

    c = ModelConfig.from_hf(config)
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * std

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    state = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size), "model.norm.weight": ones(c.hidden_size)}  # fmt: skip
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = w(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = ones(c.hidden_size)
        state[p + "post_attention_layernorm.weight"] = ones(c.hidden_size)
        state[p + "self_attn.q_proj.weight"] = w(c.q_size, c.hidden_size)
        state[p + "self_attn.k_proj.weight"] = w(c.kv_size, c.hidden_size)
        state[p + "self_attn.v_proj.weight"] = w(c.kv_size, c.hidden_size)
        state[p + "self_attn.o_proj.weight"] = w(c.hidden_size, c.q_size)
        if c.qk_norm:
            state[p + "self_attn.q_norm.weight"] = ones(c.head_dim)
            state[p + "self_attn.k_norm.weight"] = ones(c.head_dim)
        state[p + "mlp.gate_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        state[p + "mlp.up_proj.weight"] = w(c.intermediate_size, c.hidden_size)
        state[p + "mlp.down_proj.weight"] = w(c.hidden_size, c.intermediate_size)
    with torch.inference_mode():
        model = DecoderModel(c, state, device, dtype)
    del state
    return model


@dataclass
class Req:
    rid: int
    prompt: np.ndarray
    out_len: int
    slots: np.ndarray | None = None
    pages: np.ndarray | None = None
    output: list[int] = field(default_factory=list)

    @property
    def seq_len(self) -> int:  # tokens whose K/V is in the pool after the next forward
        return len(self.prompt) + len(self.output)


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        self.P = page_size
        self.free = list(range(num_pages - 1, -1, -1))

    def alloc(self, n_tokens: int):
        k = div_ceil(n_tokens, self.P)
        if k > len(self.free):
            return None
        pages = np.array([self.free.pop() for _ in range(k)], dtype=np.int64)
        slots = (pages[:, None] * self.P + np.arange(self.P)[None, :]).reshape(-1)
        return pages, slots

    def release(self, pages: np.ndarray) -> None:
        self.free.extend(int(p) for p in pages)


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("CUDA is not available; this benchmark needs a GPU", file=sys.stderr)
        return 2

    def sync():
        if cuda:
            torch.cuda.synchronize()

    from radixlm.cache import KVPool
    from radixlm.runtime.model import ForwardBatch, ModelRunner, resolve_dtype

    dtype = resolve_dtype(args.dtype, dev)
    config = dict(QWEN3_06B)
    if args.num_layers:
        config["num_hidden_layers"] = args.num_layers
    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    in_lens = rng.integers(args.min_len, args.max_len + 1, n)
    out_lens = rng.integers(args.min_len, args.max_len + 1, n)
    reqs = [
        Req(i, rng.integers(0, config["vocab_size"], int(in_lens[i])), int(out_lens[i]))
        for i in range(n)
    ]

    t0 = time.perf_counter()
    model = random_model(config, dev, dtype)
    c = model.config
    kv_per_token = ModelRunner.kv_bytes_per_token(c, dtype)
    free = torch.cuda.mem_get_info()[0] if cuda else 8 * 2**30
    need = sum(div_ceil(r.prompt.shape[0] + r.out_len, args.page_size) for r in reqs) + 64
    budget_pages = int(free * args.mem_fraction / kv_per_token) // args.page_size
    num_pages = min(need, budget_pages)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_pages * args.page_size,
                  args.page_size, dtype, dev)  # fmt: skip
    runner = ModelRunner.from_model(model, pool, attention=args.attention)
    pages = PagePool(num_pages, args.page_size)
    setup_s = time.perf_counter() - t0
    print(f"model + pool ready in {setup_s:.1f}s: {c.num_layers} layers, backend "
          f"{runner.attention}, {num_pages} pages x {args.page_size} "
          f"({num_pages * args.page_size * kv_per_token / 2**30:.1f} GiB KV)", flush=True)  # fmt: skip

    # Warm-up (FlashInfer JIT-compiles its kernels on first use): prefill + mixed + decode.
    t0 = time.perf_counter()
    wp = pages.alloc(64)
    w_slots = wp[1]
    runner.forward(ForwardBatch.build([(list(range(40)), 0, w_slots[:40])], dev))
    runner.forward(
        ForwardBatch.build([(list(range(8)), 40, w_slots[:48]), ([1], 0, w_slots[48:49])], dev)
    )
    runner.forward(ForwardBatch.build([([1], 48, w_slots[:49]), ([2], 1, w_slots[48:50])], dev))
    sync()
    pages.release(wp[0])
    warmup_s = time.perf_counter() - t0
    print(f"warm-up (incl. kernel JIT) {warmup_s:.1f}s", flush=True)

    waiting = list(reqs)
    running: list[Req] = []
    prefill_s = decode_s = 0.0
    decode_steps = prefill_batches = decode_tokens = 0
    sync()
    start = time.perf_counter()
    while waiting or running:
        # admit + prefill
        batch_reqs, budget = [], args.max_prefill_tokens
        while waiting and len(running) + len(batch_reqs) < args.max_running:
            r = waiting[0]
            if batch_reqs and r.prompt.shape[0] > budget:
                break
            got = pages.alloc(r.prompt.shape[0] + r.out_len)
            if got is None:
                break
            r.pages, r.slots = got
            batch_reqs.append(waiting.pop(0))
            budget -= r.prompt.shape[0]
        if batch_reqs:
            t = time.perf_counter()
            fb = ForwardBatch.build(
                [(r.prompt, 0, r.slots[: r.prompt.shape[0]]) for r in batch_reqs], dev
            )
            toks = runner.forward(fb).argmax(-1).tolist()
            for r, tok in zip(batch_reqs, toks, strict=True):
                r.output.append(tok)
            running.extend(batch_reqs)
            prefill_s += time.perf_counter() - t
            prefill_batches += 1
        # one decode step for everyone still generating
        for r in [r for r in running if len(r.output) >= r.out_len]:
            running.remove(r)
            pages.release(r.pages)
        if not running:
            continue
        t = time.perf_counter()
        fb = ForwardBatch.build(
            [([r.output[-1]], r.seq_len - 1, r.slots[: r.seq_len]) for r in running], dev
        )
        toks = runner.forward(fb).argmax(-1).tolist()
        for r, tok in zip(running, toks, strict=True):
            r.output.append(tok)
        decode_s += time.perf_counter() - t
        decode_steps += 1
        decode_tokens += len(running)
        for r in [r for r in running if len(r.output) >= r.out_len]:
            running.remove(r)
            pages.release(r.pages)
    sync()
    wall = time.perf_counter() - start

    in_tok, out_tok = int(in_lens.sum()), int(out_lens.sum())
    assert all(len(r.output) == r.out_len for r in reqs)
    result = {
        "model": "random-weight Qwen3-0.6B shape",
        "layers": c.num_layers,
        "attention": runner.attention,
        "dtype": str(dtype).removeprefix("torch."),
        "page_size": args.page_size,
        "requests": n,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(out_tok / wall, 1),
        "total_tok_per_s": round((in_tok + out_tok) / wall, 1),
        "requests_per_s": round(n / wall, 3),
        "prefill_s": round(prefill_s, 3),
        "prefill_batches": prefill_batches,
        "prefill_tok_per_s": round(in_tok / max(prefill_s, 1e-9), 1),
        "decode_s": round(decode_s, 3),
        "decode_steps": decode_steps,
        "mean_decode_batch": round(decode_tokens / max(decode_steps, 1), 1),
        "decode_step_ms": round(1e3 * decode_s / max(decode_steps, 1), 2),
        "setup_s": round(setup_s, 1),
        "warmup_s": round(warmup_s, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
    }
    try:
        import flashinfer  # type: ignore[import-not-found]

        result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception:  # noqa: BLE001
        result["flashinfer"] = None
    lines = ["| metric | value |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in result.items()]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.tag}.md").write_text(f"# GPU throughput\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
