"""Per-request output assembly: token ids from the engine -> Chunks and a Done.

Each branch of a request (``n > 1`` gives several) owns an `IncrementalDetokenizer` and,
if the request has stop strings, a `StopStringMatcher`. For every `TokenOutput` the
stream returns what to send: a `Chunk` (streaming requests), an `EngineFinishAt` (a stop
string matched) and, on the branch's last output, its `Done`.

Stop strings. Text is held back while it may still be the start of a stop string, and so
are the token ids whose text is held back (streamed `Chunk` ids and text always
concatenate to the `Done`'s). When a stop string matches, the branch keeps its output up
to and including the token in which the stop string begins, unless it begins exactly at
a token boundary: the kept tokens are the shortest prefix of the output whose text covers
everything before the stop string (so a session's history holds exactly the returned text
whenever the stop string starts a token). The engine is told with `EngineFinishAt`;
outputs it sent before it saw that are dropped, and its final output becomes a Done with
``finish_reason="stop"`` and the matched string.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import NamedTuple

from radixlm.runtime.engine.messages import EngineFinishAt, TokenOutput
from radixlm.runtime.protocol import (
    Chunk,
    Done,
    SamplingParams,
    ToolCall,
    TopLogprob,
    Usage,
)
from radixlm.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class Outcome(NamedTuple):
    chunk: Chunk | None = None
    finish_at: EngineFinishAt | None = None
    done: Done | None = None


_NOTHING = Outcome()
_PENDING = sys.maxsize  # text end of a token the detokenizer still holds back


class _Branch:
    """One output sequence. `kept` is set when a stop string matched."""

    __slots__ = (
        "detok", "stop", "token_ids", "texts", "logprobs", "top_logprobs", "sent",
        "decoded", "emitted", "ends", "hit", "kept", "done",
    )

    def __init__(self, tokenizer: Tokenizer, context: list[int], sampling: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=context)
        self.stop = StopStringMatcher(sampling.stop) if sampling.stop else None
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.top_logprobs: list[list[TopLogprob]] | None = [] if sampling.top_logprobs else None
        self.sent = 0  # output tokens already streamed
        # With stop strings only: characters detokenized / emitted so far, and where each
        # output token's text ends (to map text positions to tokens; _PENDING while held).
        self.decoded = 0
        self.emitted = 0
        self.ends: list[int] = []
        self.hit: str | None = None
        self.kept: int | None = None
        self.done = False


class RequestStream:
    """One in-flight Generate, from the frontend's side."""

    __slots__ = ("key", "client", "rid", "stream", "session", "appended",
                 "_tokenizer", "_sampling", "_branches", "remaining", "_tool_calls")

    def __init__(self, key: int, client: bytes, rid: str, *, stream: bool, n: int,
                 sampling: SamplingParams, session: str | None, tokenizer: Tokenizer,
                 tool_calls: Callable[[str], list[ToolCall] | None] | None = None) -> None:
        self.key = key
        self.client = client
        self.rid = rid
        self.stream = stream
        self.session = session
        self.appended: list[int] = []  # the prompt (or session append), once prepared
        self._tokenizer = tokenizer
        self._sampling = sampling
        self._branches: list[_Branch | None] = [None] * n
        self.remaining = n  # branches without a Done yet
        self._tool_calls = tool_calls  # reads a branch's calls out of its whole text

    def prepared(self, ids: list[int]) -> None:
        """The request's ids are known: the detokenizers take the prompt's tail as context."""
        self.appended = ids

    def _new_branch(self, index: int) -> _Branch:
        branch = self._branches[index] = _Branch(self._tokenizer, self.appended, self._sampling)
        return branch

    def on_output(self, out: TokenOutput) -> Outcome:
        # Runs once per streamed token of every request: attribute reads are kept few.
        index = out.index
        branches = self._branches
        if not 0 <= index < len(branches):
            return _NOTHING
        b = branches[index] or self._new_branch(index)
        if b.done:
            return _NOTHING
        final = out.finish_reason is not None
        if b.hit is not None:  # stopped: the engine's late tokens are dropped
            return Outcome(done=self._finish(b, out)) if final else _NOTHING

        start = b.sent
        ids = out.token_ids
        if b.stop is None:
            text = b.detok.feed(ids) if ids else ""
            if final:
                text += b.detok.flush()
            token_ids = b.token_ids
            token_ids += ids
            sent = b.sent = len(token_ids)
        else:
            text = self._feed_with_stops(b, ids, final)
            sent = b.sent
        if out.logprobs or out.top_logprobs:
            self._add_logprobs(b, out)
        b.texts.append(text)

        chunk = None
        if self.stream and (text or sent > start):
            logprobs, top_logprobs = b.logprobs, b.top_logprobs
            chunk = Chunk(
                rid=self.rid, text=text, token_ids=b.token_ids[start:sent],
                logprobs=logprobs[start:sent] if logprobs is not None else None,
                top_logprobs=top_logprobs[start:sent] if top_logprobs is not None else None,
                index=index,
            )
        if not final and b.hit is None:
            # NamedTuple's own __new__ is Python code; this is its C equivalent.
            return tuple.__new__(Outcome, (chunk, None, None))
        finish_at = None
        if b.hit is not None and not final:
            finish_at = EngineFinishAt(key=self.key, keep_tokens=b.kept or 0, matched_stop=b.hit,
                                       index=index)
        return Outcome(chunk, finish_at, self._finish(b, out) if final else None)

    @staticmethod
    def _feed_with_stops(b: _Branch, ids: list[int], final: bool) -> str:
        """Token by token, so a hit is pinned to the token where it happened."""
        stop, detok, ends = b.stop, b.detok, b.ends
        assert stop is not None
        emitted: list[str] = []
        hit = None
        for token in ids:
            piece = detok.feed((token,))
            b.token_ids.append(token)
            ends.append(_PENDING)
            if piece:
                _settle(ends, b.decoded + len(piece))
                b.decoded += len(piece)
                text, hit = stop.feed(piece)
                b.emitted += len(text)
                emitted.append(text)
                if hit is not None:
                    break
        if hit is None and final:
            piece = detok.flush()
            b.decoded += len(piece)
            _settle(ends, b.decoded)
            text, hit = stop.feed(piece) if piece else ("", None)
            if hit is None:
                text += stop.flush()
            b.emitted += len(text)
            emitted.append(text)
        if hit is not None:
            b.hit = hit
            # Shortest token prefix whose text covers everything before the stop string
            # (tokens that complete one character together are kept together).
            b.kept = bisect_right(ends, ends[bisect_left(ends, b.emitted)]) if b.emitted else 0
            b.sent = max(b.sent, b.kept)
        elif final:
            b.sent = len(b.token_ids)
        else:  # stream the tokens whose text has been emitted in full
            b.sent = max(b.sent, bisect_right(ends, b.emitted))
        return "".join(emitted)

    @staticmethod
    def _add_logprobs(b: _Branch, out: TokenOutput) -> None:
        if b.logprobs is not None and out.logprobs:
            b.logprobs.extend(out.logprobs)
        if b.top_logprobs is not None and out.top_logprobs:
            b.top_logprobs.extend(out.top_logprobs)

    def _finish(self, b: _Branch, out: TokenOutput) -> Done:
        b.done = True
        self.remaining -= 1
        n_out = b.kept if b.kept is not None else len(b.token_ids)
        token_ids = b.token_ids[:n_out]
        usage = out.usage or Usage(prompt_tokens=len(self.appended), cached_tokens=0,
                                   completion_tokens=n_out)
        session_length = out.session_length
        if session_length is not None and usage.completion_tokens > n_out:
            # The engine finished before our EngineFinishAt reached it, so the session's
            # history holds tokens past the stop; report the length the frontend will
            # truncate it to (Frontend sends the truncate).
            session_length -= usage.completion_tokens - n_out
        if usage.completion_tokens != n_out:
            usage = Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                          completion_tokens=n_out, recomputed_tokens=usage.recomputed_tokens,
                          restored_tokens=usage.restored_tokens)
        stopped = b.hit is not None
        text = "".join(b.texts)
        return Done(
            rid=self.rid,
            finish_reason="stop" if stopped else out.finish_reason,  # type: ignore[arg-type]
            text=text,
            token_ids=token_ids,
            usage=usage,
            matched_stop=b.hit if stopped else out.matched_stop,
            logprobs=b.logprobs[:n_out] if b.logprobs is not None else None,
            top_logprobs=b.top_logprobs[:n_out] if b.top_logprobs is not None else None,
            prompt_logprobs=out.prompt_logprobs,
            prompt_top_logprobs=out.prompt_top_logprobs,
            session=out.session,
            session_length=session_length,
            index=out.index,
            tool_calls=self._tool_calls(text) if self._tool_calls is not None else None,
        )

    def output_ids(self, index: int) -> list[int]:
        """The kept output of a finished branch (for session bookkeeping)."""
        b = self._branches[index]
        if b is None:
            return []
        return b.token_ids[: b.kept if b.kept is not None else len(b.token_ids)]


def _settle(ends: list[int], end: int) -> None:
    """The detokenizer produced text up to `end`: the tokens it was holding back (part of
    a character, a special token) end there too."""
    i = len(ends) - 1
    while i >= 0 and ends[i] == _PENDING:
        ends[i] = end
        i -= 1
