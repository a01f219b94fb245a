#!/usr/bin/env python3
"""A random-weight GGUF of a given shape, written here (nothing downloaded), for benchmarks.

The default is the "1B shape" of issue 26: Llama, 16 layers x 2048 hidden, 32 heads of 64
(8 KV heads), ffn 8192, SmolLM2's vocabulary (49,152) and tokenizer, every layer matrix
Q4_1 and the tied embedding / LM head Q8_0 (llama.cpp's Q4_1 layout): ~717 MB. Blocks are
random codes with scales that keep every weight within +-0.02, so activations stay finite
through the layers (the text is gibberish; only speed is measured). The tokenizer and chat
template are copied from SmolLM2's GGUF, so both llama-server and radixlm load it as they
load a real model. Written once into `<radixlm cache>/peer/` and reused.

    .venv/bin/python benchmarks/random_gguf.py [--layers 16 --hidden 2048 ...] \
        [--requantize Q4_K_M --llama-quantize PATH]
    .venv/bin/python benchmarks/random_gguf.py --moe [--layers 8 ...]

`--moe` writes the Qwen3-MoE shape instead (`MoeShape`: Qwen3-30B-A3B's layers, 2048
hidden, 32 heads of 128 with 4 KV heads and q/k norms, 128 experts of width 768 with 8 per
token, an F32 router; its 48 layers cut to 8 by default, ~3.0 GB): arch qwen3moe, experts
stacked 3-D as llama.cpp's converter writes them, every matrix Q4_0 (`--qtype 3`: Q4_1)
but the untied embedding and head (Q8_0).

`requantized(src, "Q4_K_M", llama_quantize)` makes a K-quant file of any GGUF with
llama.cpp's own `llama-quantize` (`--allow-requantize`: from the Q4_1 blocks), as a user
would: its mix of types is llama.cpp's (Q4_K, Q6_K for V, the head and some down
projections; Q5_0 / Q8_0 for rows not a multiple of 256), written once beside the source.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

Q4_0, Q4_1, Q8_0 = 2, 3, 8
_BLOCK = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


@dataclass(frozen=True)
class Shape:
    layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    context: int = 8192
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"random-llama-{self.layers}x{self.hidden}-h{self.heads}kv{self.kv_heads}"
                f"-ffn{self.ffn}-s{self.seed}.Q4_1.gguf")  # fmt: skip


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: int,
            lead: tuple[int, ...] = ()) -> np.ndarray:  # fmt: skip
    """`[*lead, rows, cols/32 * block bytes]` uint8: random codes, scales keeping |w| <= 0.02."""
    nb, bb = cols // 32, _BLOCK[qtype]
    raw = rng.integers(0, 256, (*lead, rows, nb, bb), dtype=np.uint8)
    if qtype == Q4_1:  # w = d q + m, q in 0..15: d = 0.04 / 15, m = -0.02
        scales = np.array([0.04 / 15, -0.02], dtype=np.float16)
        raw[..., :4] = scales.view(np.uint8)
    elif qtype == Q4_0:  # w = d (q - 8), q in 0..15
        raw[..., :2] = np.array([0.02 / 8], dtype=np.float16).view(np.uint8)
    else:  # w = d q, q in -128..127
        raw[..., :2] = np.array([0.02 / 127], dtype=np.float16).view(np.uint8)
    return raw.reshape(*lead, rows, nb * bb)


def write(shape: Shape, out: Path, tokenizer_gguf: Path) -> Path:
    """Write the random model of `shape` to `out` (atomically), tokenizer from `tokenizer_gguf`."""
    import gguf

    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    w, vocab = _writer(tmp, "llama", tokenizer_gguf)
    w.add_name(out.stem)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    rng = np.random.default_rng(shape.seed)
    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    ones = np.ones(h, dtype=np.float32)

    def quant(name: str, rows: int, cols: int, qtype: int) -> None:
        # uint8 data: gguf-py reads its shape as bytes per row and derives the elements
        w.add_tensor(name, _blocks(rng, rows, cols, qtype), raw_dtype=gguf.GGMLQuantizationType(qtype))

    quant("token_embd.weight", vocab, h, Q8_0)
    w.add_tensor("output_norm.weight", ones)
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        quant(p + "attn_q.weight", h, h, Q4_1)
        quant(p + "attn_k.weight", kv, h, Q4_1)
        quant(p + "attn_v.weight", kv, h, Q4_1)
        quant(p + "attn_output.weight", h, h, Q4_1)
        w.add_tensor(p + "ffn_norm.weight", ones)
        quant(p + "ffn_gate.weight", shape.ffn, h, Q4_1)
        quant(p + "ffn_up.weight", shape.ffn, h, Q4_1)
        quant(p + "ffn_down.weight", h, shape.ffn, Q4_1)
    return _finish(w, tmp, out)


@dataclass(frozen=True)
class MoeShape:
    """Qwen3-30B-A3B's layer (its 48 layers cut to `layers`)."""

    layers: int = 8
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    experts_used: int = 8
    expert_ffn: int = 768
    context: int = 8192
    qtype: int = Q4_0
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"random-qwen3moe-{self.layers}x{self.hidden}-h{self.heads}kv{self.kv_heads}"
                f"-e{self.experts}a{self.experts_used}-ffn{self.expert_ffn}-s{self.seed}"
                f".{'Q4_0' if self.qtype == Q4_0 else 'Q4_1'}.gguf")  # fmt: skip


def _writer(path: Path, arch: str, tokenizer_gguf: Path, pad_to: int = 0):
    """A GGUFWriter for `path` with `tokenizer_gguf`'s tokenizer and chat template (its
    token list padded with unused tokens to `pad_to` rows, if more); and its vocabulary
    size."""
    import gguf

    src = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), arch)
    for name, field in src.fields.items():  # the tokenizer and chat template, as they are
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = list(value) + [f"[PAD{i}]" for i in range(len(value), pad_to)]
        elif name == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.UNUSED)] * (pad_to - len(value))
        vtype = gguf.GGUFValueType(field.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, vtype)
    return w, max(pad_to, len(src.fields["tokenizer.ggml.tokens"].data))


def _finish(w, tmp: Path, out: Path) -> Path:
    """Write `w`'s file (at `tmp`) and rename it to `out`."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_moe(shape: MoeShape, out: Path, tokenizer_gguf: Path) -> Path:
    """Write the random Qwen3-MoE model of `shape` to `out` (atomically)."""
    import gguf

    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    w, vocab = _writer(tmp, "qwen3moe", tokenizer_gguf)
    w.add_name(out.stem)
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(6144)  # Qwen3-30B-A3B's dense width (no dense layer here)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.experts_used)
    w.add_expert_feed_forward_length(shape.expert_ffn)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0 if shape.qtype == Q4_0 else gguf.LlamaFileType.MOSTLY_Q4_1)
    rng = np.random.default_rng(shape.seed)
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def quant(name: str, rows: int, cols: int, qtype: int, lead: tuple[int, ...] = ()) -> None:
        w.add_tensor(name, _blocks(rng, rows, cols, qtype, lead), raw_dtype=gguf.GGMLQuantizationType(qtype))

    quant("token_embd.weight", vocab, h, Q8_0)
    quant("output.weight", vocab, h, Q8_0)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    t = shape.qtype
    for i in range(shape.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(h, dtype=np.float32))
        quant(p + "attn_q.weight", q, h, t)
        quant(p + "attn_k.weight", kv, h, t)
        quant(p + "attn_v.weight", kv, h, t)
        quant(p + "attn_output.weight", h, q, t)
        w.add_tensor(p + "attn_q_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(shape.head_dim, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(h, dtype=np.float32))
        router = rng.standard_normal((shape.experts, h), dtype=np.float32) * 0.02
        w.add_tensor(p + "ffn_gate_inp.weight", router)
        quant(p + "ffn_gate_exps.weight", shape.expert_ffn, h, t, (shape.experts,))
        quant(p + "ffn_up_exps.weight", shape.expert_ffn, h, t, (shape.experts,))
        quant(p + "ffn_down_exps.weight", h, shape.expert_ffn, t, (shape.experts,))
    return _finish(w, tmp, out)


def ensure(shape: Shape | MoeShape | None = None, directory: Path | None = None) -> Path:
    """The random GGUF of `shape` (default: the 1B shape), written on first use."""
    from radixlm.runtime.model import cache_root, default_gguf_path

    shape = shape or Shape()
    directory = directory or cache_root() / "peer"
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / shape.name
    if not out.is_file():
        print(f"writing {out} (random weights, {asdict(shape)})", flush=True)
        (write_moe if isinstance(shape, MoeShape) else write)(shape, out, default_gguf_path())
    return out


def requantized(src: Path, qtype: str, llama_quantize: Path, directory: Path | None = None,
                pure: bool = False) -> Path:
    """`src` requantized to `qtype` (e.g. Q4_K_M, Q6_K) by llama.cpp's llama-quantize, once:
    `<stem>.<qtype>.gguf` in `directory` (default: beside `src`); `pure`: every tensor of
    that type (llama-quantize --pure), not llama.cpp's mix."""
    out = (directory or src.parent) / f"{src.stem}.{qtype}{'-pure' if pure else ''}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    print(f"writing {out} (llama-quantize --allow-requantize {src.name} {qtype})", flush=True)
    try:
        flags = ["--allow-requantize", *(["--pure"] if pure else [])]
        done = subprocess.run([str(llama_quantize), *flags, str(src), str(tmp), qtype, str(os.cpu_count() or 1)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            sys.exit(f"llama-quantize failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    moe = "--moe" in (sys.argv[1:] if argv is None else argv)
    p.add_argument("--moe", action="store_true", help="the Qwen3-MoE shape (MoeShape)")
    for field, default in asdict(MoeShape() if moe else Shape()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    p.add_argument("--requantize", default=None, help="also write it as this type (e.g. Q4_K_M)")
    p.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize binary")
    args = vars(p.parse_args(argv))
    args.pop("moe")
    qtype, binary = args.pop("requantize"), args.pop("llama_quantize")
    path = ensure(MoeShape(**args) if moe else Shape(**args))
    if qtype:
        if not binary:
            sys.exit("--requantize needs --llama-quantize")
        path = requantized(path, qtype, Path(binary))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
