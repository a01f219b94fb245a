"""Requests as the scheduler sees them: a group per client request, a branch per sequence.

A `RequestGroup` is what one `EngineGenerate` / `EngineOpenSession` / `EnginePin` asked
for; its `n` branches (`Request`) are the sequences that own KV and are scheduled. The
KV bookkeeping of a branch is four lengths over its own slot table (`slots[i]` is the
pool slot of position i):

    0 ........ tree_len ........ kv_len ..... alloc_len
    |  in the tree |  private, computed | private, allocated, not yet written |

`slots[:tree_len]` belong to the radix tree (the path `locked` protects, or pages the
request handed to the tree at finish); `slots[tree_len:alloc_len]` are the request's
private slots, so `alloc_len - tree_len` is its share of the pool's `private` count.
`tree_len` and `alloc_len` are page-aligned, so private pages start page-aligned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from radixlm.cache import TreeNode
from radixlm.cache.pages import align_up
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.protocol import SamplingParams, TopLogprob

if TYPE_CHECKING:
    from radixlm.runtime.engine.sessions.controller import Turn
    from radixlm.runtime.engine.timings import GroupTimes
    from radixlm.runtime.grammar.compiler import CompiledGrammar, CompilingGrammar
    from radixlm.runtime.grammar.matcher import GrammarState
    from radixlm.tokenizer import TokenStopMatcher

__all__ = ["Request", "RequestGroup", "RequestKind"]


class RequestKind(enum.Enum):
    GENERATE = "generate"  # answered with TokenOutputs
    OPEN_SESSION = "open_session"  # prefill only, then its turn ends; answered SessionOpened
    PIN = "pin"  # prefill only, then the prefix is pinned; answered Pinned


@dataclass(eq=False)
class RequestGroup:
    """One client request: its prompt, parameters and what its branches share."""

    key: int  # the frontend's key (negative: an engine-internal prefill-only request)
    kind: RequestKind
    client: bytes
    rid: str
    prompt: np.ndarray  # int64, the full prompt (session history included)
    sampling: SamplingParams
    n: int = 1
    namespace: str | None = None
    turn: Turn | None = None  # a session turn or a pin: the session controller's state
    prompt_logprobs_start: int | None = None
    priority: int = 0
    branches: list[Request] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids, plus EOS unless ignore_eos
    token_limit: int = 0  # prompt + output stops at this many tokens (max_tokens, context)
    # Filled in as the request runs.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[TopLogprob]] | None = None
    prefilled: bool = False  # branch 0 has computed the whole prompt once
    # Constrained output: the compiled grammar (a `CompilingGrammar` while the group
    # waits in `RequestTable.compiling`); each branch then owns its `Request.grammar`.
    grammar: CompiledGrammar | CompilingGrammar | None = None
    recomputed_tokens: int = 0
    restored_tokens: int = 0
    times: GroupTimes | None = None  # a Generate's moments (timings.py)
    # The tools whose calls its output may make (a session turn ending in calls of them
    # leaves its session waiting on them), and the program it is part of (policy.py's
    # "program" admits programs by attained service; None: a program of its own).
    tools: tuple[str, ...] | None = None
    program: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs_start is not None


@dataclass(eq=False, slots=True)
class Request:
    """One sequence (branch `index` of `group`) and its KV state; see the module doc."""

    group: RequestGroup
    index: int
    arrival: int  # global sequence number: FCFS order, and "newest" for retraction
    tokens: np.ndarray  # int64 buffer: prompt, then output; valid up to num_tokens
    slots: np.ndarray  # int64 buffer: slot of each position; valid up to alloc_len
    num_tokens: int
    state: ReqState = ReqState.WAITING
    output: list[int] = field(default_factory=list)
    kv_len: int = 0
    alloc_len: int = 0
    tree_len: int = 0
    locked: TreeNode | None = None  # the node this request holds a lock on
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    generator: torch.Generator | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    plp_next: int = 0  # next prompt position whose logprob is still owed
    after: Request | None = None  # hold in the queue until this one has prefilled
    # Sampled its last token but ends one step later, once that token's KV is computed
    # (a session turn: the next turn must hit the whole history): (reason, matched stop).
    pending_end: tuple[str, int | str | None] | None = None
    # Its Done already went out (before its tail row ran): nothing more is emitted for it.
    reported: bool = False
    grammar: GrammarState | None = None  # this branch's place in its group's grammar
    # With stop strings: this branch's matcher, and how many output tokens went to the
    # frontend (only those it released: the others may begin a stop string).
    stops: TokenStopMatcher | None = None
    sent: int = 0
    # Its prefill chunk is computing in slices (slicing.py): nobody else schedules it.
    slicing: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None

    @classmethod
    def new(cls, group: RequestGroup, index: int, arrival: int, page_size: int) -> Request:
        prompt = group.prompt
        cap = len(prompt) + group.max_tokens
        tokens = np.empty(max(cap, 1), dtype=np.int64)
        tokens[: len(prompt)] = prompt
        slot_cap = align_up(cap, page_size)
        req = cls(
            group=group,
            index=index,
            arrival=arrival,
            tokens=tokens,
            slots=np.empty(max(slot_cap, page_size), dtype=np.int64),
            num_tokens=len(prompt),
        )
        if group.wants_prompt_logprobs and index == 0:
            # Position 0 has no prediction: logprobs start at token 1 at the earliest.
            req.plp_next = max(int(group.prompt_logprobs_start or 0), 1)
        else:
            req.plp_next = len(prompt)
        return req

    @property
    def key(self) -> int:
        return self.group.key

    @property
    def private(self) -> int:
        """Slots this request holds outside the tree."""
        return self.alloc_len - self.tree_len

    @property
    def owes_prompt_logprobs(self) -> bool:
        return self.plp_next < self.group.prompt_len

    @property
    def compute_from(self) -> int:
        """The first position that must be computed, however much of it is cached: its
        last token (its logits sample the next one), or the first position whose prompt
        logprob is still owed. Matches and restores are capped here."""
        last = self.num_tokens - 1
        return min(last, self.plp_next - 1) if self.plp_next < self.group.prompt_len else last

    @property
    def remaining_new_tokens(self) -> int:
        return self.group.max_tokens - len(self.output)

    @property
    def is_prefill_only(self) -> bool:
        return self.group.kind is not RequestKind.GENERATE or self.group.max_tokens == 0

    def __repr__(self) -> str:
        return (
            f"Request(key={self.key}, index={self.index}, state={self.state.name}, "
            f"tokens={self.num_tokens}, kv={self.kv_len}, tree={self.tree_len}, "
            f"alloc={self.alloc_len})"
        )
