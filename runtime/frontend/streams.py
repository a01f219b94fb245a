"""Per-request output assembly: token ids from the engine -> Chunks and a Done.

Each branch of a request (``n > 1`` gives several) owns an `IncrementalDetokenizer`. For
every `TokenOutput` the stream returns what to send: a `Chunk` (streaming requests) and,
on the branch's last output, its `Done`.

The engine ends every turn, stop strings included (tokenizer/stop.py
`TokenStopMatcher`): it sends only tokens whose text is before any stop string, and the
last output says how many characters of its text belong to the matched stop string
(`text_trim`), which are left out. A matched stop token id's own text is left out too
(the token stays in `token_ids` and the history), as SGLang trims it. So the streamed
chunks concatenate to the Done's text and ids, and the Done's session length is the
engine's. With ``logprob_texts`` every chunk and Done maps the token ids it carries
(output, top alternatives, prompt) to their texts, each decoded alone. With tools whose
calls are read, each branch's `CallReader` reads its text as it comes: a streamed chunk
carries the text outside calls and the pieces of calls, the Done the complete calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from radixlm.runtime.engine.wire import TokenOutput
from radixlm.runtime.frontend.structured import CallReader
from radixlm.runtime.protocol import (
    Chunk,
    Done,
    SamplingParams,
    TopLogprob,
    Usage,
)
from radixlm.tokenizer import IncrementalDetokenizer, Tokenizer


class Outcome(NamedTuple):
    chunk: Chunk | None = None
    done: Done | None = None


_NOTHING = Outcome()


class _Branch:
    """One output sequence."""

    __slots__ = ("detok", "token_ids", "texts", "logprobs", "top_logprobs", "done", "calls")

    def __init__(self, tokenizer: Tokenizer, context: list[int], sampling: SamplingParams,
                 calls: CallReader | None) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=context)
        self.calls = calls
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.top_logprobs: list[list[TopLogprob]] | None = [] if sampling.top_logprobs else None
        self.done = False


class RequestStream:
    """One in-flight Generate, from the frontend's side."""

    __slots__ = ("key", "client", "rid", "stream", "session", "appended",
                 "_tokenizer", "_sampling", "_branches", "remaining", "_calls", "_texts")

    def __init__(self, key: int, client: bytes, rid: str, *, stream: bool, n: int,
                 sampling: SamplingParams, session: str | None, tokenizer: Tokenizer,
                 calls: Callable[[], CallReader | None] | None = None,
                 logprob_texts: bool = False) -> None:
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
        self._calls = calls  # a branch's call reader
        self._texts = logprob_texts  # token ids' texts ride with the logprobs

    def prepared(self, ids: list[int]) -> None:
        """The request's ids are known: the detokenizers take their tail as context (the
        engine's stop matcher takes the same)."""
        self.appended = ids

    def _new_branch(self, index: int) -> _Branch:
        branch = self._branches[index] = _Branch(
            self._tokenizer, self.appended, self._sampling,
            self._calls() if self._calls is not None else None)
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
        ids = out.token_ids
        start = len(b.token_ids)
        if final and ids and isinstance(out.matched_stop, int) and out.matched_stop == ids[-1]:
            text = b.detok.feed(ids[:-1])  # a matched stop token's text is trimmed
        else:
            text = b.detok.feed(ids) if ids else ""
        if final:
            text += b.detok.flush()
            if out.text_trim:  # the stop string's start, inside the last kept token
                text = text[: max(0, len(text) - out.text_trim)]
        b.token_ids += ids
        if out.logprobs or out.top_logprobs:
            self._add_logprobs(b, out)
        b.texts.append(text)
        chunk = None
        if self.stream:
            content, pieces = b.calls.read(text, final) if b.calls is not None else (None, None)
            if text or ids or content or pieces:
                sent = len(b.token_ids)
                logprobs, top_logprobs = b.logprobs, b.top_logprobs
                chunk = Chunk(
                    rid=self.rid, text=text, token_ids=ids,
                    logprobs=logprobs[start:sent] if logprobs is not None else None,
                    top_logprobs=top_logprobs[start:sent] if top_logprobs is not None else None,
                    index=index, content=content, tool_calls=pieces,
                )
                if self._texts:
                    chunk.token_texts = self._token_texts(ids, chunk.top_logprobs)
        if not final:
            # NamedTuple's own __new__ is Python code; this is its C equivalent.
            return tuple.__new__(Outcome, (chunk, None))
        return Outcome(chunk, self._finish(b, out))

    @staticmethod
    def _add_logprobs(b: _Branch, out: TokenOutput) -> None:
        if b.logprobs is not None and out.logprobs:
            b.logprobs.extend(out.logprobs)
        if b.top_logprobs is not None and out.top_logprobs:
            b.top_logprobs.extend(out.top_logprobs)

    def _token_texts(self, ids: list[int], tops: list[list[TopLogprob]] | None,
                     more: list[int] | None = None) -> dict[int, str]:
        """Each token id's text, decoded alone (SGLang's return_text_in_logprobs)."""
        token_text = self._tokenizer.token_text  # memoised
        alternatives = (alt.token_id for row in tops or () for alt in row)
        return {t: token_text(t) for t in (*ids, *alternatives, *(more or ()))}

    def _finish(self, b: _Branch, out: TokenOutput) -> Done:
        b.done = True
        self.remaining -= 1
        text = "".join(b.texts)
        calls = b.calls
        if calls is not None and not self.stream:
            calls.read(text, final=True)  # (streamed: read as it came)
        done = Done(
            rid=self.rid,
            finish_reason=out.finish_reason,  # type: ignore[arg-type]
            text=text,
            token_ids=b.token_ids,
            usage=out.usage or Usage(prompt_tokens=len(self.appended), cached_tokens=0,
                                     completion_tokens=len(b.token_ids)),
            matched_stop=out.matched_stop,
            logprobs=b.logprobs,
            top_logprobs=b.top_logprobs,
            prompt_logprobs=out.prompt_logprobs,
            prompt_top_logprobs=out.prompt_top_logprobs,
            prompt_token_ids=out.prompt_token_ids,
            session=out.session,
            session_length=out.session_length,
            index=out.index,
            tool_calls=calls.calls if calls is not None else None,
        )
        if self._texts:
            tops = [*(b.top_logprobs or ()), *(out.prompt_top_logprobs or ())]
            done.token_texts = self._token_texts(b.token_ids, tops, out.prompt_token_ids)
        return done
