"""One request's prefill chunk computed in pieces, so that other forwards can run between
them (the engine's preemptible prefill: engine/slicing.py).

A piece is one decoder layer over a block of the chunk's rows: layer by layer, and within
a layer in row order, so a block's attention reads (from the pool) the K/V of the rows
before it, which the earlier blocks of this layer wrote. A quantized layer is dequantized
once for all its pieces (`decoder.dense_layer`; `QuantWeight.matmul` would dequantize per
call, 8x the work for 8 pieces). Each piece is planned as its own
one-request batch (`attn.plan`), so a forward interleaved between pieces, which plans the
backend for its own batch, clobbers nothing this one needs. The chunk's hidden states
stay here between pieces; its K/V for the finished pieces are already in the request's
own slots, which nothing else reads (the chunk joins the tree only once it is complete).

Only the CPU torch backend (`ModelRunner.sliceable`): FlashInfer/CUDA plans hold device
state and do not need this; tensor parallelism replays whole steps on its workers.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from .batch import ForwardBatch, pack_forward_batch
from .decoder import DecoderLayer, DecoderModel, dense_layer

_I64 = np.int64


class SlicedPrefill:
    """`extend` tokens of one sequence from `kv_len` on (`tokens`/`slots` hold the whole
    sequence from position 0), in pieces of at most `rows` rows; `advance` runs pieces
    for about `budget_s` and returns the logits of offsets `logits_from ..` once the last
    layer is done (as `ModelRunner.forward` would for that one-request batch)."""

    def __init__(self, model: DecoderModel, attn, tokens: np.ndarray, slots: np.ndarray,
                 kv_len: int, extend: int, logits_from: int, rows: int,
                 device: torch.device, done: Callable[[int], None] | None = None,
                 ) -> None:  # fmt: skip
        self.model = model
        self._done = done  # called with the chunk's length once it is complete
        self.attn = attn
        self.logits_from = logits_from
        self.num_tokens = extend
        self.pieces: list[tuple[int, int, ForwardBatch]] = []
        for a in range(0, extend, max(1, rows)):
            n = min(rows, extend - a)
            sub = pack_forward_batch([tokens], [slots], np.array([kv_len + a], _I64),
                                     np.array([n], _I64), np.array([n - 1], _I64), device)
            self.pieces.append((a, a + n, sub))
        with torch.inference_mode():
            ids = torch.from_numpy(np.ascontiguousarray(tokens[kv_len : kv_len + extend]))
            self.x = model.embed_tokens(ids.to(device))
        self.layer = 0
        self.piece = 0
        self.pieces_run = 0  # (tests and stats)
        self._dense: DecoderLayer | None = None  # this layer's weights, dequantized once

    @property
    def total_pieces(self) -> int:
        return len(self.pieces) * len(self.model.layers)

    def advance(self, budget_s: float) -> torch.Tensor | None:
        """Run pieces (at least one) until `budget_s` has passed; the logits when the
        chunk is complete, else None."""
        model, attn = self.model, self.attn
        t0 = time.perf_counter()
        with torch.inference_mode():
            while True:
                a, b, sub = self.pieces[self.piece]
                if self._dense is None:
                    self._dense = dense_layer(model.layers[self.layer])
                attn.plan(sub)
                cos, sin = model.rotary_for(self.layer).cos_sin(sub.positions)
                rows = self.x[a:b]
                out = model.layer_forward(self.layer, rows, cos, sin, attn, self._dense)
                if out.data_ptr() != rows.data_ptr():
                    rows.copy_(out)
                self.pieces_run += 1
                self.piece += 1
                if self.piece == len(self.pieces):
                    self.piece = 0
                    self.layer += 1
                    self._dense = None
                    if self.layer == len(model.layers):
                        break
                if time.perf_counter() - t0 >= budget_s:
                    return None
            hidden = self.x[self.logits_from :]
            attn.release()
        with torch.no_grad():  # (outside inference mode: sampling edits logits in place)
            logits = model.compute_logits(hidden)
        self.x = hidden = None  # type: ignore[assignment]
        if self._done is not None:
            self._done(self.num_tokens)
        return logits
