"""Batched sampling with per-request parameters.

`Sampler.sample` turns one row of logits per request into one token per request. Each row
goes through, in this order (the order of transformers' and vLLM's processors):

1. vocabulary: columns past `vocab_size` (padding of the embedding matrix) are dropped;
2. penalties: repetition (HF/CTRL rule, over prompt + output tokens: a positive logit is
   divided by the penalty, a negative one multiplied), then frequency and presence
   (OpenAI rule, over output tokens only: ``logit -= frequency * count + presence *
   (count > 0)``);
3. greedy rows (``temperature <= 1e-5``) take the argmax here;
4. temperature scaling;
5. top-k (keeps every token whose logit is >= the k-th largest: ties at the boundary are
   kept, as in transformers), then top-p on the top-k-renormalised distribution (keeps a
   token while the probability mass strictly before it, in descending order, is < p: the
   smallest set reaching p; tokens tied with the last kept one stay too), then min-p
   (keeps tokens with probability >= min_p times the most likely one's). Top-p sorts only
   each row's 1024 largest logits unless those hold less than p (then the whole row);
6. sampling by inverse CDF: one uniform ``u`` per row, the token where the float64
   cumulative probability first exceeds ``u`` times the row's total (one random number
   and one cumulative sum a row: an exponential race, one Exp(1) draw per vocabulary
   entry, cost 5.6 ms a step for 9 rows of SmolLM2's 49,152 on this CPU). A row with its
   own `torch.Generator` (seeded request) draws its uniform from it alone, so its tokens
   depend only on its seed and its own logits, never on which other requests share the
   batch or in which order (tested on CPU and CUDA; a seed gives different tokens on CPU
   and on CUDA, whose generators differ). Unseeded rows share one draw from torch's
   default generator.

Before all of these, a grammar `mask` (``runtime.grammar.bitmask.TokenMask``: the whole batch's
token bitmask, filled in one pass) sets the tokens a constrained row's grammar forbids
to -inf, and `banned` tokens (a row below its ``min_tokens``: EOS and stop ids) are set to
-inf too, unless nothing would be left.

Logprobs are those of the **raw model distribution**: ``log_softmax`` of the logits
before penalties, temperature and filtering (what SGLang and vLLM report by default and
what `select()`-style scoring needs), restricted by the grammar mask and the banned
tokens when a row has them (the constrained distribution: forbidden tokens have
probability 0); a request asks
with ``logprobs`` (the sampled token's) and ``top_logprobs`` (that many alternatives,
most likely first).

Parameters are read by attribute from any object shaped like `radixlm.runtime.protocol.
SamplingParams` (this module does not import the protocol). `validate_sampling` checks
them before a request is admitted; it and the constants live in the torch-free
`radixlm.runtime.rules` (the frontend imports that) and are re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from radixlm.runtime.rules import (
    GREEDY_EPS,
    MAX_TOP_LOGPROBS,
    PENALTY_RANGE,
    SamplingParamsLike,
    validate_sampling,
)

__all__ = [
    "GREEDY_EPS",
    "MAX_TOP_LOGPROBS",
    "PENALTY_RANGE",
    "PromptLogprobs",
    "SampleOutput",
    "Sampler",
    "SamplingParamsLike",
    "make_generator",
    "prompt_logprobs",
    "validate_sampling",
]

_PROMPT_LOGPROB_CHUNK = 1024  # rows per log_softmax in prompt_logprobs (bounds memory)
_TOP_P_CANDIDATES = 1024  # logits sorted per row for top-p before falling back to all


class SampleOutput(NamedTuple):
    """One entry per batch row. `logprobs`/`top_logprobs` are None when no row asked for
    logprobs; otherwise `logprobs` has every row's sampled-token logprob and
    `top_logprobs[i]` has row i's ``top_logprobs`` alternatives (``[]`` if it asked none)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class LogitsMask(Protocol):
    """Restricts some rows of a logits batch (``runtime.grammar.bitmask.TokenMask``)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...


class PromptLogprobs(NamedTuple):
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


def _ban(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """Set each row's `banned` tokens to -inf in place, unless nothing else is allowed."""
    for i, ids in enumerate(banned):
        if not ids:
            continue
        cols = torch.as_tensor(list(ids), device=logits.device)
        row = logits[i]
        kept = row.index_select(0, cols)
        row.index_fill_(0, cols, -math.inf)
        if not torch.isfinite(row).any():  # only these were allowed: they stay
            row.index_copy_(0, cols, kept)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request (None for an unseeded one), on the logits' device."""
    if seed is None:
        return None
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(int(seed) % (1 << 64))  # negative seeds wrap, as torch.manual_seed does
    return g


def _is_greedy(p: SamplingParamsLike) -> bool:
    return p.temperature <= GREEDY_EPS


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum (NaN counts as the maximum, as in torch). On CPU numpy's
    SIMD argmax: torch's took 130 us for one 49,152-entry row here, numpy's 6 us."""
    if logits.device.type != "cpu" or logits.requires_grad:
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64, copy=False))


def _argmax_only(logits: torch.Tensor, params: Sequence[SamplingParamsLike]) -> bool:
    """Whether sampling is each row's argmax and nothing else: float32 CPU logits, every
    row greedy without logprobs or penalties."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad
            and all(_is_greedy(p) and not _wants_logprobs(p) and not _has_penalty(p) for p in params))  # fmt: skip


def _wants_logprobs(p: SamplingParamsLike) -> bool:
    return bool(p.logprobs) or p.top_logprobs > 0


def _has_penalty(p: SamplingParamsLike) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def _ids_array(ids: Any) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
    return np.asarray(ids, dtype=np.int64).reshape(-1)


class Sampler:
    """Samples one token per row of a logits batch; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParamsLike],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        mask: LogitsMask | None = None,
        banned: Sequence[Sequence[int]] | None = None,
    ) -> SampleOutput:
        """Sample a token for each row of `logits` ``[B, V]`` (float32, V >= vocab_size).

        `output_ids[i]`: tokens row i generated so far (frequency/presence/repetition
        penalties); `prompt_ids[i]`: its prompt (repetition penalty; None = output only);
        `generators[i]`: row i's generator from `make_generator` (None = unseeded);
        `mask`: the grammar mask of the batch (None: no row is constrained), applied to
        `logits` in place (float32 logits of exactly `vocab_size` columns are not copied
        first: the caller must not reuse them). `banned[i]`: tokens row i may not sample
        now (``min_tokens``: its EOS and stop ids), set to -inf after the grammar mask --
        unless that would leave the row nothing (a grammar whose match is complete allows
        only EOS): then they stay.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(output_ids) != batch:
            raise ValueError(
                f"batch of {batch} logits rows but {len(params)} params and "
                f"{len(output_ids)} output histories"
            )
        if prompt_ids is not None and len(prompt_ids) != batch:
            raise ValueError(f"batch of {batch} rows but {len(prompt_ids)} prompts")
        if generators is not None and len(generators) != batch:
            raise ValueError(f"batch of {batch} rows but {len(generators)} generators")
        if batch == 0:
            return SampleOutput([], None, None)
        if mask is None and banned is None and _argmax_only(logits, params):
            # The common decode row, right after a forward has left the caches cold: each
            # row's first maximum with no tensor made (as `_argmax_rows`, NaN the maximum).
            return SampleOutput(logits.numpy()[:, : self.vocab_size].argmax(axis=-1).tolist(), None, None)

        logits = logits[:, : self.vocab_size].float()
        if mask is not None:  # in place: the caller hands its rows over to sampling
            logits = mask.apply(logits)
        if banned is not None:
            _ban(logits, banned)
        want_lp = [_wants_logprobs(p) for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        logits = self.apply_penalties(logits, params, output_ids, prompt_ids)

        tokens = _argmax_rows(logits)
        sampled = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            picked = self._sample_rows(
                logits.index_select(0, rows),
                [params[i] for i in sampled],
                [generators[i] if generators is not None else None for i in sampled],
            )
            tokens = tokens.index_copy(0, rows, picked)

        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleOutput(token_list, None, None)
        chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_n = max(p.top_logprobs for p in params)
        top = _top_pairs(raw_logprobs, [p.top_logprobs for p in params], top_n)
        return SampleOutput(token_list, chosen, top)

    # -- penalties ---------------------------------------------------------------------

    def apply_penalties(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParamsLike],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """`logits` ``[B, vocab]`` with each row's repetition, frequency and presence
        penalties applied (a new tensor; `logits` itself if no row has a penalty)."""
        rows = [i for i, p in enumerate(params) if _has_penalty(p)]
        if not rows:
            return logits
        return self._apply_penalties(logits.clone(), params, rows, output_ids, prompt_ids)

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParamsLike],
        rows: list[int],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None,
    ) -> torch.Tensor:
        """Penalties for `rows` (rebuilt from the histories each step: O(their length))."""
        dev, vocab = logits.device, logits.shape[1]
        n = len(rows)
        sub = logits.index_select(0, torch.tensor(rows, device=dev))

        out_arrays = [_ids_array(output_ids[i]) for i in rows]
        out_rows = np.repeat(np.arange(n), [len(a) for a in out_arrays])
        out_flat = np.concatenate(out_arrays) if out_arrays else np.zeros(0, np.int64)
        keep = (out_flat >= 0) & (out_flat < vocab)
        out_rows_t = torch.from_numpy(out_rows[keep]).to(dev)
        out_flat_t = torch.from_numpy(out_flat[keep]).to(dev)
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=dev)
        counts.index_put_(
            (out_rows_t, out_flat_t),
            torch.ones_like(out_flat_t, dtype=torch.float32),
            accumulate=True,
        )

        rep = [float(params[i].repetition_penalty) for i in rows]
        if any(r != 1.0 for r in rep):
            seen = counts > 0
            if prompt_ids is not None:
                pr_arrays = [_ids_array(prompt_ids[i]) for i in rows]
                pr_rows = np.repeat(np.arange(n), [len(a) for a in pr_arrays])
                pr_flat = np.concatenate(pr_arrays) if pr_arrays else np.zeros(0, np.int64)
                keep = (pr_flat >= 0) & (pr_flat < vocab)
                seen[
                    torch.from_numpy(pr_rows[keep]).to(dev), torch.from_numpy(pr_flat[keep]).to(dev)
                ] = True
            rep_t = torch.tensor(rep, dtype=torch.float32, device=dev).unsqueeze(1)
            penalized = torch.where(sub < 0, sub * rep_t, sub / rep_t)
            sub = torch.where(seen, penalized, sub)

        freq = torch.tensor(
            [float(params[i].frequency_penalty) for i in rows], dtype=torch.float32, device=dev
        ).unsqueeze(1)
        pres = torch.tensor(
            [float(params[i].presence_penalty) for i in rows], dtype=torch.float32, device=dev
        ).unsqueeze(1)
        sub = sub - freq * counts - pres * (counts > 0).float()
        logits[torch.tensor(rows, device=dev)] = sub
        return logits

    # -- sampling ------------------------------------------------------------------------

    def warp(self, logits: torch.Tensor, params: Sequence[SamplingParamsLike]) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p: `logits` ``[B, vocab]`` scaled, with
        the tokens each row may not sample set to -inf (a new tensor). Rows are treated as
        sampled rows (a greedy row's temperature is taken as 1)."""
        dev, vocab = logits.device, logits.shape[1]
        temps = [float(p.temperature) if not _is_greedy(p) else 1.0 for p in params]
        x = logits / torch.tensor(temps, dtype=torch.float32, device=dev).unsqueeze(1)

        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ps = [float(p.top_p) for p in params]
        if any(k < vocab for k in ks) or any(p < 1.0 for p in ps):
            x = self._top_k_top_p(x, ks, ps)

        min_ps = [float(p.min_p) for p in params]
        if any(m > 0.0 for m in min_ps):
            probs = x.softmax(dim=-1)
            m_t = torch.tensor(min_ps, dtype=torch.float32, device=dev).unsqueeze(1)
            x = x.masked_fill(probs < m_t * probs.amax(dim=-1, keepdim=True), -math.inf)
        return x

    def _top_k_top_p(self, x: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
        """Mask by value thresholds found among each row's largest logits.

        Only the top `width` logits are sorted (`topk`), not the whole vocabulary: enough
        for every row's top-k, and for top-p whenever those candidates already hold mass p
        (the usual case); otherwise the whole row is sorted. Thresholds are values, so
        tokens tied with the last kept one are kept too (the result never depends on how
        a sort orders equal logits).
        """
        dev, vocab = x.device, x.shape[1]
        limited = [k for k in ks if k < vocab]
        width = min(vocab, max([_TOP_P_CANDIDATES, *limited]))
        k_t = torch.tensor(ks, device=dev).unsqueeze(1)
        # Rows without top-p get p = inf: float rounding must not drop their tail.
        p_t = torch.tensor([p if p < 1.0 else math.inf for p in ps], device=dev).unsqueeze(1)
        need_p = any(p < 1.0 for p in ps)
        while True:
            if width < vocab:
                vals = x.topk(width, dim=-1).values  # sorted, largest first
            else:
                vals = x.sort(dim=-1, descending=True).values
            if limited:
                kth = vals.gather(1, (k_t - 1).clamp(max=width - 1))
                kth = kth.masked_fill(k_t >= vocab, -math.inf)
                x = x.masked_fill(x < kth, -math.inf)
                vals = vals.masked_fill(vals < kth, -math.inf)
            if not need_p:
                return x
            probs = (vals - x.logsumexp(dim=-1, keepdim=True)).exp()
            cum = probs.cumsum(dim=-1)
            if width < vocab and bool((cum[:, -1:] < p_t).any()):
                width = vocab  # some row needs more than the candidates: sort it all
                continue
            kept = (cum - probs < p_t).sum(dim=-1, keepdim=True).clamp(min=1)
            return x.masked_fill(x < vals.gather(1, kept - 1), -math.inf)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: list[SamplingParamsLike],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        probs = self.warp(logits, params).softmax(dim=-1)
        # One uniform per row: its own generator's for a seeded row, else one shared draw.
        u = torch.empty(len(generators), dtype=torch.float64, device=dev)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            u.uniform_()
        else:
            for i, g in enumerate(generators):
                if g is not None:
                    u[i : i + 1].uniform_(generator=g)
            if shared:
                idx = torch.tensor(shared, device=dev)
                u.index_copy_(0, idx, torch.empty(len(shared), dtype=torch.float64,
                                                  device=dev).uniform_())  # fmt: skip
        # Inverse CDF in float64: the first token whose cumulative probability exceeds u
        # times the row's total (a token of probability 0 never raises the sum, so it is
        # never the first to exceed it).
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        x = (u * cdf[:, -1]).unsqueeze(1)
        tok = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=vocab - 1)
        # (u * total can round up to total itself: then the last token with probability)
        bad = probs.gather(1, tok.unsqueeze(1)).squeeze(1) <= 0
        if bool(bad.any()):
            last = vocab - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
            tok = torch.where(bad, last, tok)
        return tok


def _top_pairs(
    logprobs: torch.Tensor, counts: list[int], top_n: int
) -> list[list[tuple[int, float]]]:
    if top_n <= 0:
        return [[] for _ in counts]
    vals, idx = logprobs.topk(min(top_n, logprobs.shape[1]), dim=-1)
    vals_l, idx_l = vals.tolist(), idx.tolist()
    pairs = [list(zip(idx_l[r][:n], vals_l[r][:n], strict=True)) for r, n in enumerate(counts)]
    if bool(torch.isinf(vals).any()):  # a grammar left fewer tokens than asked for
        pairs = [[(t, v) for t, v in row if v != -math.inf] for row in pairs]
    return pairs


def prompt_logprobs(
    logits: torch.Tensor,
    target_ids: Sequence[int] | torch.Tensor | np.ndarray,
    top_n: int = 0,
    vocab_size: int | None = None,
) -> PromptLogprobs:
    """Logprob of each `target_ids[i]` under ``log_softmax(logits[i])`` (raw logits, no
    sampling parameters), plus the `top_n` most likely tokens per row if asked.

    Row i of `logits` ``[n, V]`` is the model's prediction for target i (for a prompt,
    the logits at position j score token j+1). Columns past `vocab_size` are dropped.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    targets = torch.as_tensor(_ids_array(target_ids), device=logits.device)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows but {targets.shape[0]} targets")
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    values: list[float] = []
    top: list[list[tuple[int, float]]] | None = [] if top_n > 0 else None
    for start in range(0, logits.shape[0], _PROMPT_LOGPROB_CHUNK):
        chunk = torch.log_softmax(logits[start : start + _PROMPT_LOGPROB_CHUNK].float(), dim=-1)
        tgt = targets[start : start + _PROMPT_LOGPROB_CHUNK]
        values.extend(chunk.gather(1, tgt.unsqueeze(1)).squeeze(1).tolist())
        if top is not None:
            top.extend(_top_pairs(chunk, [top_n] * chunk.shape[0], top_n))
    return PromptLogprobs(values, top)
