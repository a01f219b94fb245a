#!/usr/bin/env python3
"""A random-weight GGUF of Gemma 3 1B's shape, written here with gguf-py (llama.cpp's own
GGUF writer), for bench_peer.py's Gemma 3 rows; nothing downloaded.

The shape is google/gemma-3-1b-it's: 26 layers x 1152 hidden, 4 query heads and 1 KV
head of 256, ffn 6912, a vocabulary of 262,144 (the rows a llama.cpp Gemma 3 GGUF keeps),
a 512-token sliding window on five of every six layers, RoPE bases 10,000 (local) and
1,000,000 (global), q/k norms and the four norms of a Gemma layer. Every layer matrix is
Q4_1 and the tied embedding / LM head Q8_0, as random_gguf.py's Llama 1B shape (random
codes, scales keeping |w| <= 0.02; norms 1). The tokenizer is SmolLM2's (byte-level BPE,
which llama.cpp's gemma3 architecture accepts), its token list padded with unused tokens
to the 262,144 rows. Written once into `<radixlm cache>/peer/` and reused.

    .venv/bin/python benchmarks/random_gguf_gemma3.py
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# (benchmarks/ is the script's own directory)
from random_gguf import Q4_1, Q8_0, _blocks, _finish, _writer


@dataclass(frozen=True)
class Gemma3Shape:
    layers: int = 26
    hidden: int = 1152
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 256
    ffn: int = 6912
    vocab: int = 262144
    window: int = 512
    pattern: int = 6
    context: int = 32768
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"random-gemma3-{self.layers}x{self.hidden}-h{self.heads}kv{self.kv_heads}"
                f"d{self.head_dim}-ffn{self.ffn}-v{self.vocab}-s{self.seed}.Q4_1.gguf")  # fmt: skip


def write(shape: Gemma3Shape, out: Path, tokenizer_gguf: Path) -> Path:
    """Write the random Gemma 3 of `shape` to `out` (atomically)."""
    import gguf

    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    w, _ = _writer(tmp, "gemma3", tokenizer_gguf, pad_to=shape.vocab)
    w.add_name(out.stem)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_sliding_window(shape.window)
    w.add_sliding_window_pattern(shape.pattern)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    rng = np.random.default_rng(shape.seed)
    h, d = shape.hidden, shape.head_dim
    ones = np.ones(h, dtype=np.float32)  # llama.cpp's Gemma norms hold 1 + w: w = 0

    def quant(name: str, rows: int, cols: int, qtype: int) -> None:
        w.add_tensor(name, _blocks(rng, rows, cols, qtype), raw_dtype=gguf.GGMLQuantizationType(qtype))

    quant("token_embd.weight", shape.vocab, h, Q8_0)
    w.add_tensor("output_norm.weight", ones)
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        quant(p + "attn_q.weight", shape.heads * d, h, Q4_1)
        quant(p + "attn_k.weight", shape.kv_heads * d, h, Q4_1)
        quant(p + "attn_v.weight", shape.kv_heads * d, h, Q4_1)
        w.add_tensor(p + "attn_q_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(d, dtype=np.float32))
        quant(p + "attn_output.weight", h, shape.heads * d, Q4_1)
        w.add_tensor(p + "post_attention_norm.weight", ones)
        w.add_tensor(p + "ffn_norm.weight", ones)
        quant(p + "ffn_gate.weight", shape.ffn, h, Q4_1)
        quant(p + "ffn_up.weight", shape.ffn, h, Q4_1)
        quant(p + "ffn_down.weight", h, shape.ffn, Q4_1)
        w.add_tensor(p + "post_ffw_norm.weight", ones)
    return _finish(w, tmp, out)


def ensure(shape: Gemma3Shape | None = None, directory: Path | None = None) -> Path:
    """The random Gemma 3 GGUF of `shape` (default: the 1B shape), written on first use."""
    from radixlm.runtime.model import cache_root, default_gguf_path

    shape = shape or Gemma3Shape()
    directory = directory or cache_root() / "peer"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / shape.name
    if not out.is_file():
        print(f"writing {out} (random weights, {asdict(shape)})", flush=True)
        write(shape, out, default_gguf_path())
    return out


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
