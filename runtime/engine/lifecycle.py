"""How requests leave the running set: finish, abort, fail, or retract (requeue).

Every ending goes through `Endings.end`: settle the branch's stop strings (the output is
cut where one matched), cache its KV (not after an error), settle its session turn or
pin, unlock, free its private slots, leave the queues and emit its last output. Shared
pages are never freed at finish.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from radixlm.runtime.engine.cache_manager import CacheManager
from radixlm.runtime.engine.outbox import Outbox
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.engine.sessions.controller import SessionController
from radixlm.runtime.engine.state import TERMINAL, ReqState
from radixlm.runtime.engine.table import Counters, RequestTable
from radixlm.runtime.engine.wire import TokenOutput
from radixlm.runtime.protocol import Error, ErrorCode, Usage
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endings:
    """Every way a branch leaves the scheduler, with what it owes the cache, its session
    and its client."""

    table: RequestTable
    kv: CacheManager
    sessions: SessionController
    outbox: Outbox
    counters: Counters

    def end(
        self,
        r: Request,
        state: ReqState,
        reason: str,
        matched: int | str | None = None,
        *,
        out: TokenOutput | None = None,
        error: RequestError | None = None,
    ) -> None:
        """Finish/abort one branch: cache its KV (not after an error), settle its session
        turn or pin, unlock, free its private slots, and emit its last output."""
        g = r.group
        r.slicing = False  # (a slice in progress is dropped: slicing.py)
        if r.stops is not None and error is None and not r.reported:
            reason, matched = self.settle(r, reason, matched)
        try:
            if r.locked is not None and error is None:
                self.kv.cache_finished(r)
            if state is ReqState.FINISHED:
                self.sessions.on_finish(r)
            else:
                self.sessions.on_abort(r)
        finally:
            if r.locked is not None or r.alloc_len:
                self.kv.detach(r)
            self.table.move(r, state)
        r.finish_reason, r.matched_stop = reason, matched
        if state is ReqState.FINISHED:
            self.counters.finished += 1
        if r.reported:  # its Done went out already; the session is idle again now
            self.sessions.on_ended(r, finished=state is ReqState.FINISHED)
        elif g.kind is RequestKind.GENERATE:
            self.emit_last(r, out, error)
        if all(b.state in TERMINAL for b in g.branches):
            self.table.drop_group(g)
            self.sessions.on_group_done(g)

    def settle(self, r: Request, reason: str, matched: int | str | None
               ) -> tuple[str, int | str | None]:
        """A branch with stop strings ends: the text its matcher held back may still
        complete one. Once one has matched, the output is cut to the kept tokens and the
        branch ends with "stop" and that string (whatever else ended it)."""
        stops = r.stops
        assert stops is not None
        if not stops.finish():
            return reason, matched
        keep = stops.kept
        assert keep is not None
        if len(r.output) > keep:
            del r.output[keep:]
            r.num_tokens = r.group.prompt_len + keep
            if r.logprobs is not None:
                del r.logprobs[keep:]
            if r.top_logprobs is not None:
                del r.top_logprobs[keep:]
        return "stop", stops.matched

    def wait_for_tail(self, r: Request, reason: str, matched: int | str | None,
                      out: TokenOutput | None) -> None:
        """`r` (a session turn) has its last token but ends one step later, once that
        token's KV is computed (one more decode row, no sampling), or the next turn would
        miss it. An n == 1 turn reports its Done now, so the client waits no extra step."""
        r.pending_end = (reason, matched)
        if self.sessions.report_early(r):
            r.reported = True
            r.finish_reason, r.matched_stop = reason, matched
            self.emit_last(r, out, None)

    def end_pending(self, r: Request) -> None:
        """End a branch that was waiting for its tail row (see `Request.pending_end`)."""
        assert r.pending_end is not None
        self.end(r, ReqState.FINISHED, *r.pending_end)

    def emit_last(self, r: Request, out: TokenOutput | None, error: RequestError | None) -> None:
        """The branch's last output: finish reason, usage, prompt logprobs, session."""
        g = r.group
        outputs = self.outbox.outputs
        if error is not None:
            outputs.append(TokenOutput(key=g.key, token_ids=[], index=r.index,
                                       finish_reason="error"))  # fmt: skip
            return
        if out is None:
            out = TokenOutput(key=g.key, token_ids=[], index=r.index)
            outputs.append(out)
        if r.stops is not None:  # what the matcher held back goes with the last output
            sent = r.sent
            out.token_ids = r.output[sent:]
            if r.logprobs is not None:
                out.logprobs = r.logprobs[sent:]
                out.top_logprobs = r.top_logprobs[sent:] if r.top_logprobs is not None else None
            out.text_trim = r.stops.trim
            r.sent = len(r.output)
        out.finish_reason = r.finish_reason
        out.matched_stop = r.matched_stop
        if g.times is not None:
            self.counters.latency.branch_ended(g.times, g.n, r.finish_reason or "stop",
                                               len(r.output))
        out.usage = Usage(
            prompt_tokens=g.prompt_len,
            cached_tokens=max(r.cached_tokens, 0),
            completion_tokens=len(r.output),
            recomputed_tokens=g.recomputed_tokens,
            restored_tokens=g.restored_tokens,
        )
        if g.prompt_logprobs_start is not None:
            out.prompt_logprobs = g.prompt_logprobs or []
            out.prompt_top_logprobs = g.prompt_top_logprobs
            # Position 0 has no logprob: they are of the tokens from max(start, 1) on.
            out.prompt_token_ids = g.prompt[max(g.prompt_logprobs_start, 1):].tolist()
        session = g.turn.ended_in.get(r.index) if g.turn is not None else None
        if session is not None:
            out.session = session
            out.session_length = r.num_tokens

    def retract(self, r: Request, reason: str = "to free KV", level: int = logging.INFO) -> bool:
        """Give the pool (or its running slot) back: computed KV → cache, private slots →
        free; requeue with the output kept (it resumes as prompt + output so far); True. A
        turn that only waits for its last token's KV ends now instead (that token is
        recomputed by the next turn); False."""
        if r.pending_end is not None:
            self.end_pending(r)
            return False
        r.slicing = False
        self.kv.cache_finished(r)
        self.kv.detach(r)
        self.table.move(r, ReqState.RETRACTED)
        self.table.move(r, ReqState.WAITING)
        self.counters.retractions += 1
        log.log(level, "retracted request %s (%d+%d tokens) %s; it will resume",
                r.group.rid, r.group.prompt_len, len(r.output), reason)  # fmt: skip
        return True

    def fail_group(self, g: RequestGroup, error: RequestError) -> None:
        """End every live branch of `g` with an error: one Error reply to the client.
        A turn that already reported Done ends quietly (its history stands without the
        tail: the next turn recomputes that one token)."""
        for r in g.branches:
            if r.reported and r.state not in TERMINAL:
                try:
                    self.end_pending(r)
                except Exception:  # noqa: BLE001 - fall through to failing it
                    log.exception("could not end reported turn %s", g.rid)
        if all(r.state in TERMINAL for r in g.branches):
            return
        ends = g.key if g.kind is RequestKind.GENERATE else None
        self.outbox.reply(g.client, Error(rid=g.rid, code=error.code, message=error.message), ends)
        for r in g.branches:
            if r.state not in TERMINAL:
                try:
                    self.end(r, ReqState.ABORTED, "error", error=error)
                except Exception:  # noqa: BLE001 - keep failing the others
                    log.exception("could not release request %s cleanly", g.rid)

    def fail(self, reqs: Iterable[Request], exc: BaseException) -> None:
        """An internal error while these requests were being worked on: fail their
        groups (INTERNAL)."""
        error = RequestError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        for g in {id(r.group): r.group for r in reqs}.values():
            if any(r.state not in TERMINAL for r in g.branches):
                self.fail_group(g, error)

    def abort(self, key: int) -> None:
        """The client aborted: finish every live branch with "abort" (computed KV stays
        as cache). A turn that already reported Done just ends: its history stands."""
        g = self.table.groups.get(key)
        if g is None:
            return
        for r in g.branches:
            if r.state in TERMINAL:
                continue
            if r.reported:
                self.end_pending(r)
            else:
                self.end(r, ReqState.ABORTED, "abort")
