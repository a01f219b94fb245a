"""One step's work as a `ForwardBatch`, built from the requests' own buffers.

Every scheduled request extends its KV by `extend` tokens from `kv_len` on (a prefill
chunk, or 1 for a decode); the tokens and slots are already in the request's buffers, so
the model package's `pack_forward_batch` slices them (no per-token Python, one device
copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from radixlm.runtime.engine.request import Request
from radixlm.runtime.model.batch import ForwardBatch, pack_forward_batch

_I64 = np.int64


class Scheduled(NamedTuple):
    """A request's share of one forward: `extend` new tokens; logits are returned for
    its extend offsets `logits_from .. extend - 1` (the last one samples the next token,
    earlier ones are prompt-logprob positions)."""

    req: Request
    extend: int
    logits_from: int


def build_batch(plan: Sequence[Scheduled], device: torch.device) -> ForwardBatch:
    """The plan's batch: request buffers hold whole sequences (`tokens`, `slots` from
    position 0), so the new tokens start at `kv_len`, as do their positions."""
    b = len(plan)
    kv0 = [s.req.kv_len for s in plan]
    tokens = [s.req.tokens for s in plan]
    slots = [s.req.slots for s in plan]
    if all(s.extend == 1 and s.logits_from == 0 for s in plan):
        return pack_forward_batch(tokens, slots, kv0, None, None, device)
    ext = np.fromiter([s.extend for s in plan], _I64, b)
    first = np.fromiter([s.logits_from for s in plan], _I64, b)
    return pack_forward_batch(tokens, slots, kv0, ext, first, device)
