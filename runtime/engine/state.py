"""The request state machine: one enum and the one table of legal transitions.

    WAITING ──admit──▶ PREFILLING ──last chunk──▶ DECODING ──stop──▶ FINISHED
       ▲                  │    └─ prefill-only / first token stops ──▶ FINISHED
       └──── RETRACTED ◀──┴─────── (pool exhausted) ◀────┘
    any live state ──abort / error──▶ ABORTED

Every state change goes through `advance` (called only by `RequestTable.move`, which
moves the request between queues with it), so an illegal one (a bug) raises at once
instead of corrupting the KV accounting that depends on the state.
"""

from __future__ import annotations

import enum
from typing import Protocol


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV and no lock
    PREFILLING = "prefilling"  # admitted; prompt (or its next chunk) being computed
    DECODING = "decoding"  # generating one token per step
    RETRACTED = "retracted"  # pushed out of the pool; its computed KV went to the cache
    FINISHED = "finished"  # stopped normally; KV inserted into the tree or freed
    ABORTED = "aborted"  # cancelled or failed; KV released


_S = ReqState

TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    _S.WAITING: frozenset({_S.PREFILLING, _S.ABORTED}),
    # RETRACTED from PREFILLING: a half-prefilled chunked request gives its pages back
    # when running decodes need them.
    _S.PREFILLING: frozenset({_S.DECODING, _S.FINISHED, _S.RETRACTED, _S.ABORTED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.RETRACTED, _S.ABORTED}),
    _S.RETRACTED: frozenset({_S.WAITING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}

LIVE_WITH_KV = frozenset({_S.PREFILLING, _S.DECODING})  # states that may hold locks/slots
TERMINAL = frozenset({_S.FINISHED, _S.ABORTED})


class IllegalTransition(RuntimeError):
    """A state change the table does not allow (a scheduler bug)."""


class HasState(Protocol):
    state: ReqState


def advance(obj: HasState, new: ReqState) -> None:
    """Move `obj` to `new`, or raise IllegalTransition."""
    old = obj.state
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old.name} -> {new.name} is not a legal request transition")
    obj.state = new
