"""After the forward: record the computed KV, take prompt logprobs, sample, and turn
each sampled token into a `TokenOutput` (finishing the branches that stop).

After a prefill chunk its pages are inserted at once (duplicates freed, the lock moved
to the new node), so requests sharing the prefix and a later retraction hit them. A
session turn's last token ends its branch one step later (its *tail* row computes that
token's KV, see `Endings.wait_for_tail`); a plain request ends at once, since its last
token joins no history.

A constrained branch (its group has a grammar) samples under the batch's grammar mask;
its token then advances its `GrammarState`, and when the grammar forces the text that
follows, the jump-forward tokens replace it (computed by the next step as one extend).

The engine ends every branch: a stop token id or EOS, the grammar's end, the token limit,
or a stop string or stop_regex (a branch with either feeds its tokens to its
`TokenStopMatcher` and sends on only the tokens the matcher releases; the others may begin
a stop string). Below its ``min_tokens`` a branch cannot sample its EOS or stop ids (the
sampler masks them, unless nothing else is allowed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.cache_manager import CacheManager
from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.outbox import Outbox
from radixlm.runtime.engine.request import Request
from radixlm.runtime.engine.sampling import Sampler, prompt_logprobs
from radixlm.runtime.engine.sessions.controller import SessionController
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.table import Counters, RequestTable
from radixlm.runtime.engine.wire import TokenOutput
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.protocol import ErrorCode, TopLogprob
from radixlm.runtime.rules import RequestError


@dataclass(eq=False)
class OutputProcessor:
    """Turns one forward's logits into KV bookkeeping, samples and outputs."""

    table: RequestTable
    kv: CacheManager
    sampler: Sampler
    sessions: SessionController
    endings: Endings
    outbox: Outbox
    counters: Counters
    grammars: Grammars | None = None

    def after_forward(self, plan: list[Scheduled], logits: torch.Tensor) -> None:
        to_sample: list[Request] = []
        rows: list[int] = []
        row = 0
        decoding = ReqState.DECODING
        for s in plan:
            r, ext = s.req, s.extend
            if r.state is decoding:  # the hot path: one token in, one token out
                r.kv_len += ext
                row += ext - s.logits_from
                if r.pending_end is not None:  # its last token's KV is now computed
                    self.endings.end_pending(r)
                    continue
                to_sample.append(r)
                rows.append(row - 1)
                continue
            n_rows = ext - s.logits_from
            if r.owes_prompt_logprobs:
                self._take_prompt_logprobs(r, logits[row : row + n_rows], r.kv_len + s.logits_from)
            row += n_rows
            self.counters.computed_tokens += ext
            r.kv_len += ext
            # Insert what is computed now (a chunk: for dedup and retraction; the whole
            # prompt: its pages become shared) and move the lock there.
            self.kv.cache_prefix(r, r.kv_len, relock=True)
            if r.kv_len < r.num_tokens:
                continue
            if r.index == 0:
                r.group.prefilled = True
            if r.is_prefill_only:
                self.endings.end(r, ReqState.FINISHED, "length")
                continue
            self.table.move(r, decoding)
            to_sample.append(r)
            rows.append(row - 1)
        if to_sample:
            self._sample(to_sample, logits, rows)

    def _take_prompt_logprobs(self, r: Request, rows: torch.Tensor, first_pos: int) -> None:
        """Rows predict tokens first_pos+1 ...; keep those the request still owes."""
        g = r.group
        lo = max(0, r.plp_next - 1 - first_pos)
        hi = min(rows.shape[0], g.prompt_len - 1 - first_pos)
        if hi <= lo:
            return
        targets = r.tokens[first_pos + lo + 1 : first_pos + hi + 1]
        top_n = g.sampling.top_logprobs
        res = prompt_logprobs(rows[lo:hi], targets, top_n, self.sampler.vocab_size)
        if g.prompt_logprobs is None:
            g.prompt_logprobs = []
            g.prompt_top_logprobs = [] if top_n else None
        g.prompt_logprobs.extend(res.logprobs)
        if res.top_logprobs is not None and g.prompt_top_logprobs is not None:
            g.prompt_top_logprobs.extend(_tops(t) for t in res.top_logprobs)
        r.plp_next = first_pos + hi + 1

    def _sample(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> None:
        if len(rows) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        params = [r.group.sampling for r in reqs]
        prompts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [r.tokens[: r.group.prompt_len] for r in reqs]
        gens = [r.generator for r in reqs]
        states = self._grammar_states(reqs)
        banned = None
        if any(p.min_tokens for p in params):  # below it, EOS and stop ids are masked
            banned = [r.group.stop_ids if len(r.output) < p.min_tokens else ()
                      for r, p in zip(reqs, params, strict=True)]
        res = self.sampler.sample(
            logits, params, [r.output for r in reqs], prompts,
            gens if any(g is not None for g in gens) else None,
            mask=self.grammars.mask(states) if states is not None else None,  # type: ignore[union-attr]
            banned=banned,
        )  # fmt: skip
        self.counters.generated_tokens += len(reqs)
        outputs = self.outbox.outputs
        lps, tops = res.logprobs, res.top_logprobs
        for i, (r, tok) in enumerate(zip(reqs, res.token_ids, strict=True)):
            if r.state is not ReqState.DECODING:
                continue  # its group failed on an earlier row
            state = states[i] if states is not None else None
            n = r.num_tokens
            g = r.group
            toks = [tok] if state is None else self._advance(r, state, tok)
            if toks is None:
                continue  # failed
            out = TokenOutput(key=g.key, token_ids=toks, index=r.index)
            if r.logprobs is not None and lps is not None:
                r.logprobs.append(lps[i])
                out.logprobs = [lps[i]]
                if r.top_logprobs is not None and tops is not None:
                    top = _tops(tops[i])
                    r.top_logprobs.append(top)
                    out.top_logprobs = [top]
            if g.times is not None and not r.output:
                self.counters.latency.first_token(g.times)
            end = n + len(toks)
            r.tokens[n:end] = toks
            r.num_tokens = end
            r.output.extend(toks)
            reason: str | None = None
            matched: int | None = tok
            if tok in g.stop_ids or (state is not None and state.terminated):
                reason = "stop"
            elif end >= g.token_limit:
                reason, matched = "length", None
            stops = r.stops
            if stops is None:
                outputs.append(out)
                if reason is not None:
                    self._finish(r, reason, matched, out)
            elif stops.feed(toks):  # (its last output is made as it ends)
                self._finish(r, "stop", stops.matched, None)
            elif reason is not None:
                self._finish(r, reason, matched, None)
            else:
                self._release(r, out)

    def _grammar_states(self, reqs: list[Request]) -> list[GrammarState | None] | None:
        """Each row's grammar state (a branch gets its own at its first token); None
        when no row is constrained."""
        if self.grammars is None or all(r.group.grammar is None for r in reqs):
            return None
        states: list[GrammarState | None] = []
        for r in reqs:
            g = r.group
            if g.grammar is not None and r.grammar is None:
                r.grammar = self.grammars.new_state(g.grammar, g.stop_ids)
            states.append(r.grammar)
        return states

    def _advance(self, r: Request, state: GrammarState, tok: int) -> list[int] | None:
        """The tokens a constrained branch appends for sampled `tok`: itself, or the
        jump-forward run that starts with it (not when logprobs are asked: forced tokens
        have none)."""
        n = r.num_tokens
        assert self.grammars is not None
        before = state.accepted
        toks = self.grammars.advance(state, int(r.tokens[n - 1]), tok, r.group.token_limit - n,
                                     jump=r.logprobs is None)
        if toks is None:  # the mask forbids it: a bug, not the client's fault
            self.endings.fail_group(r.group, RequestError(
                ErrorCode.INTERNAL, f"sampled token {tok} is not allowed by the grammar"))
            return None
        self.counters.jumped_tokens += state.accepted - before - 1
        return toks

    def _release(self, r: Request, out: TokenOutput) -> None:
        """Send on what the branch's stop matcher has released (nothing, while its new
        tokens may begin a stop string)."""
        assert r.stops is not None
        sent, released = r.sent, r.stops.released
        if released <= sent:
            return
        out.token_ids = r.output[sent:released]
        if r.logprobs is not None:
            out.logprobs = r.logprobs[sent:released]
            out.top_logprobs = r.top_logprobs[sent:released] if r.top_logprobs is not None else None
        r.sent = released
        self.outbox.outputs.append(out)

    def _finish(self, r: Request, reason: str, matched: int | str | None,
                out: TokenOutput | None) -> None:
        """The branch has its last token (`out`: this step's output, already queued; None
        for a branch with stop strings, whose last output is made at its end)."""
        if r.stops is not None:
            reason, matched = self.endings.settle(r, reason, matched)
        if self.sessions.needs_tail(r.group) and r.kv_len < r.num_tokens:
            self.endings.wait_for_tail(r, reason, matched, out)
        else:
            self.endings.end(r, ReqState.FINISHED, reason, matched, out=out)


def _tops(pairs: list[tuple[int, float]]) -> list[TopLogprob]:
    return [TopLogprob(token_id=t, logprob=lp) for t, lp in pairs]
