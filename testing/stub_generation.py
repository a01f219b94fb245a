"""The stub's generations: `Generate` (checked as the engine checks it, then run over
the toy model, all at once or one token per branch per `token_delay_s`) and `Abort`.
Stops (EOS, stop ids, stop strings and regexes), ``min_tokens``, logprobs, prompt
logprobs, streaming chunks and the session a generation ends in follow the protocol."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from radixlm.runtime import protocol as p
from radixlm.testing.stub_state import Refused, StubSession, StubState
from radixlm.testing.toy_model import (
    CONTEXT_LENGTH,
    EOS,
    decode,
    encode_text,
    toy_logprob,
    toy_next_token,
)

__all__ = ["GenerationMessages"]

Send = Callable[[bytes, p.Struct], None]


@dataclass
class _Branch:
    index: int
    output: list[int] = field(default_factory=list)
    text: str = ""
    done: bool = False


@dataclass
class _Job:
    client: bytes
    msg: p.Generate
    prompt: list[int]
    cached: int
    branches: list[_Branch]
    session: StubSession | None
    appended: int = 0
    next_at: float = 0.0


class GenerationMessages:
    """Generate and Abort, answered over `send`; `step` advances paced generations."""

    def __init__(self, state: StubState, send: Send, token_delay_s: float) -> None:
        self._state = state
        self._send = send
        self.token_delay_s = token_delay_s
        self.jobs: dict[tuple[bytes, str], _Job] = {}
        self.max_running = 0
        self.generated_tokens_total = 0

    def handlers(self) -> dict[type, Callable[[bytes, Any], None]]:
        return {p.Generate: self.generate, p.Abort: self.abort}

    def generate(self, client: bytes, msg: p.Generate) -> None:
        if (client, msg.rid) in self.jobs:
            raise Refused(p.ErrorCode.DUPLICATE_ID, f"rid {msg.rid!r} in flight")
        _check_sampling(msg)
        state = self._state
        session = state.owned(client, msg.session) if msg.session is not None else None
        if session is not None and session.busy:
            raise Refused(p.ErrorCode.BUSY, f"session {msg.session!r} is busy")
        appended = state.ids_of(msg.input, session)
        prompt = (session.history if session is not None else []) + appended
        if not prompt:
            raise Refused(p.ErrorCode.EMPTY_PROMPT, "the prompt is empty")
        sp = msg.sampling
        if sp.max_tokens is None:  # what is left of the context
            sp = msgspec.structs.replace(sp, max_tokens=max(1, CONTEXT_LENGTH - len(prompt)))
        if len(prompt) + sp.max_tokens > CONTEXT_LENGTH:
            raise Refused(p.ErrorCode.TOO_LONG, "prompt + max_tokens exceeds the context")
        start = msg.prompt_logprobs_start
        history = len(prompt) - len(appended)
        if start is not None and not -history <= start <= len(appended):
            raise Refused(p.ErrorCode.INVALID_PARAMS,
                          f"prompt_logprobs_start ({start}) must be in [{-history}, "
                          f"{len(appended)}]")
        if not 0 <= sp.min_tokens <= sp.max_tokens:
            raise Refused(p.ErrorCode.INVALID_PARAMS,
                          f"min_tokens must be in [0, max_tokens], got {sp.min_tokens}")
        for pattern in sp.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise Refused(p.ErrorCode.INVALID_PARAMS,
                              f"stop_regex {pattern!r} is not a valid regex: {e}") from None
        cached = state.compute(prompt)
        if session is not None:
            session.busy = True
            if msg.input.messages is not None:
                session.open_assistant = msg.input.add_generation_prompt
        if sp is not msg.sampling:
            msg = msgspec.structs.replace(msg, sampling=sp)
        job = _Job(client, msg, prompt, cached, [_Branch(i) for i in range(msg.n)], session,
                   appended=len(appended), next_at=time.monotonic() + self.token_delay_s)
        self.jobs[(client, msg.rid)] = job
        self.max_running = max(self.max_running, len(self.jobs))
        if self.token_delay_s == 0:
            self._run(job, until_done=True)

    def step(self) -> None:
        """One token for each branch of each generation whose delay has passed."""
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.next_at <= now:
                self._run(job, until_done=False)
                job.next_at = now + self.token_delay_s

    def abort(self, client: bytes, msg: p.Abort) -> None:
        job = self.jobs.pop((client, msg.rid), None)
        if job is None:
            raise Refused(p.ErrorCode.NOT_FOUND, f"no request {msg.rid!r} in flight")
        for b in job.branches:
            if not b.done:
                self._finish(job, b, "abort", None)
        if job.session is not None:
            job.session.busy = False

    def _run(self, job: _Job, *, until_done: bool) -> None:
        for b in job.branches:
            if not b.done:
                self._advance(job, b, until_done)
        if all(b.done for b in job.branches):
            self.jobs.pop((job.client, job.msg.rid), None)

    def _advance(self, job: _Job, b: _Branch, until_done: bool) -> None:
        """Branch `b`'s next token (with `until_done`, every token to its end)."""
        sp = job.msg.sampling
        assert sp.max_tokens is not None  # set in `generate`
        enders: set[int] = set()
        if sp.min_tokens:  # masked until min_tokens: EOS (unless ignored) and stop ids
            enders = set(sp.stop_token_ids) if sp.ignore_eos else {EOS, *sp.stop_token_ids}
        shift = (sp.seed or 0) + b.index if sp.temperature > 0 else 0
        while True:
            if len(b.output) >= sp.max_tokens:
                self._finish(job, b, "length", None)
                return
            banned = enders if len(b.output) < sp.min_tokens else ()
            token = toy_next_token(job.prompt + b.output, shift, banned)
            b.output.append(token)
            self.generated_tokens_total += 1
            if token == EOS and not sp.ignore_eos:
                self._finish(job, b, "stop", EOS)
                return
            if token in sp.stop_token_ids:  # its text is not output (as SGLang trims it)
                self._finish(job, b, "stop", token)
                return
            b.text += decode([token])
            hit = next((s for s in sp.stop if s in b.text), None)
            if hit is not None:
                b.text = b.text[: b.text.index(hit)]
                b.output = encode_text(b.text)
                self._finish(job, b, "stop", hit)
                return
            pattern = sp.stop_regex and next(
                (r for r in sp.stop_regex if re.search(r, b.text)), None)
            if pattern:
                # SGLang's trim: at the pattern's text, if it occurs literally; a match of
                # anything else stays in the output.
                cut = b.text.find(pattern)
                if cut != -1:
                    b.text = b.text[:cut]
                    b.output = encode_text(b.text)
                elif job.msg.stream:
                    self._chunk(job, b, [token])
                self._finish(job, b, "stop", pattern)
                return
            if job.msg.stream:
                self._chunk(job, b, [token])
            if not until_done:
                return

    def _chunk(self, job: _Job, b: _Branch, tokens: list[int]) -> None:
        logprobs = None
        if job.msg.sampling.logprobs:
            start = len(b.output) - len(tokens)
            logprobs = [toy_logprob(job.prompt + b.output[: start + i], t)
                        for i, t in enumerate(tokens)]
        texts = {t: decode([t]) for t in tokens} if job.msg.logprob_texts else None
        self._send(job.client, p.Chunk(rid=job.msg.rid, text=decode(tokens), token_ids=tokens,
                                       logprobs=logprobs, index=b.index, token_texts=texts))

    def _finish(self, job: _Job, b: _Branch, reason: str, matched: str | int | None) -> None:
        b.done = True
        msg = job.msg
        if all(x.done for x in job.branches):  # not running once its last Done is out
            self.jobs.pop((job.client, msg.rid), None)
        session_id, length = self._end_in_session(job, b, reason)
        self._state.trie.insert(job.prompt + b.output)
        prompt_logprobs = prompt_ids = None
        if msg.prompt_logprobs_start is not None:  # from the appended input (< 0: history)
            seq = job.prompt
            start = len(seq) - job.appended + msg.prompt_logprobs_start
            positions = range(max(1, start), len(seq))
            prompt_logprobs = [toy_logprob(seq[:i], seq[i]) for i in positions]
            prompt_ids = [seq[i] for i in positions]
        texts = None
        if msg.logprob_texts:  # a toy token's text is its character
            texts = {t: decode([t]) for t in (*b.output, *(prompt_ids or ()))}
        self._send(job.client, p.Done(
            rid=msg.rid, finish_reason=reason, text=b.text, token_ids=list(b.output),  # type: ignore[arg-type]
            usage=p.Usage(prompt_tokens=len(job.prompt), cached_tokens=job.cached,
                          completion_tokens=len(b.output)),
            matched_stop=matched, prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids,
            logprobs=[toy_logprob(job.prompt + b.output[:i], t) for i, t in enumerate(b.output)]
            if msg.sampling.logprobs else None,
            session=session_id, session_length=length, index=b.index, token_texts=texts,
        ))

    def _end_in_session(self, job: _Job, b: _Branch, reason: str) -> tuple[str | None, int | None]:
        """The session branch `b` ended in, and its length: the request's own (n = 1), or
        a new one per branch (n > 1; the request's goes back to its prompt)."""
        if job.session is None:
            return None, None
        out = b.output if reason != "abort" else []
        if job.msg.n == 1:
            job.session.history = job.prompt + out
            job.session.busy = False
            return job.msg.session, len(job.session.history)
        sid = self._state.new_session(job.client, job.prompt + out, job.session.namespace,
                                      job.session.open_assistant)
        if all(x.done for x in job.branches):
            job.session.history = list(job.prompt)
            job.session.busy = False
        return sid, len(job.prompt + out)


def _check_sampling(msg: p.Generate) -> None:
    """The request's own limits, checked before its session and its input."""
    if not 1 <= msg.n <= p.MAX_N:
        raise Refused(p.ErrorCode.INVALID_PARAMS, f"n must be in [1, {p.MAX_N}], got {msg.n}")
    sp = msg.sampling
    if (sp.max_tokens is not None and sp.max_tokens < 0) or sp.temperature < 0 \
            or not 0 < sp.top_p <= 1:
        raise Refused(p.ErrorCode.INVALID_PARAMS, "bad sampling parameters")
    if not 0 <= sp.top_logprobs <= p.MAX_TOP_LOGPROBS:
        raise Refused(p.ErrorCode.INVALID_PARAMS,
                      f"top_logprobs must be in [0, {p.MAX_TOP_LOGPROBS}]")

