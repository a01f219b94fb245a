"""Conversion of caller inputs to the arrays the cache works on.

Token ids and slots are int64 everywhere (docs/architecture.md), inside the tree too:
measured on the lifecycle benchmark, storing them as int32 (half the memory) lost more
to the int64<->int32 conversions on every match/insert than it saved.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

I64 = np.dtype(np.int64)
KEY = I64  # storage type of keys (raw bytes) inside the tree
VAL = I64  # storage type of slot values inside the tree
ITEM = KEY.itemsize  # bytes per token in a node's key

EMPTY = np.zeros(0, dtype=I64)
EMPTY.flags.writeable = False
EMPTY_VAL = EMPTY  # the value of slot-less nodes (roots)


def as_i64(x: np.ndarray | Sequence[int]) -> np.ndarray:
    """A 1-D int64 array view of `x` (no copy when it already is one)."""
    if type(x) is np.ndarray and x.dtype == I64:
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D array of token ids/slots, got shape {x.shape}")
        return x
    arr = np.asarray(x, dtype=I64)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids/slots, got shape {arr.shape}")
    return arr


def frozen_values(slots: np.ndarray | Sequence[int]) -> np.ndarray:
    """A private, read-only copy of `slots`: tree values are handed out without copying
    (match results, splits), so nobody may write through them."""
    out = np.array(slots, dtype=VAL)  # always a copy, even of an array of VAL
    if out.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of slots, got shape {out.shape}")
    out.flags.writeable = False
    return out
