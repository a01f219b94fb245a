"""``radixlm.testing``: test radixlm programs and clients without a model.

`StubServer` is a stand-in engine speaking the radixlm protocol (no model, no torch), for
tests of programs and clients and for measuring the SDK's own overhead. It behaves as the
engine does wherever a client can tell: tests/protocol/test_stub_conformance.py runs one suite against
both.

It binds a ROUTER socket and answers every client message the way the engine does, over
a toy model:

- tokens are characters (token id = code point, EOS = 0); chat messages render as ChatML
  text, appended messages as a delta that first closes an assistant turn left open;
- the next token and every logprob are deterministic functions of the last few tokens
  (a sampled request, ``temperature > 0``, is shifted by its ``seed``, 0 if none, plus its
  branch index: seeds act as in the engine), so results can be recomputed independently
  (`toy_next_token`, `toy_logprob`);
- a prefix trie of every sequence it has "computed" gives ``usage.cached_tokens`` as a
  radix cache would; sessions, forks, pins, busy/ownership errors follow the protocol;
- `token_delay_s` paces generation (one token per branch per delay), to observe
  concurrency and cancellation; ``0`` answers at once (for SDK overhead benchmarks).

    with StubServer() as stub:
        with rl.connect(stub.endpoint) as client: ...

``python -m radixlm.testing --endpoint ipc:///tmp/x.sock`` serves until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import tempfile
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as p

__all__ = [
    "CONTEXT_LENGTH", "EOS", "IM_END", "IM_START", "StubServer", "render_chatml",
    "toy_logprob", "toy_next_token",
]

EOS = 0  # the toy model's end-of-sequence token id
ALPHABET = "abcdefghij klmnop."  # what the toy model writes
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML markers of the stub's template
CONTEXT_LENGTH = 8192  # the stub's context length (its Welcome says so)


def toy_next_token(seq: list[int], branch: int = 0, banned: Collection[int] = ()) -> int:
    """The toy model's next token after `seq`: EOS now and then, else a letter. A token in
    `banned` (masked, as ``min_tokens`` masks EOS and stop ids) gives way to the next
    letter of the alphabet that is not."""
    h = (sum(seq[-3:]) * 31 + len(seq) * 7 + branch * 13) % 101
    token = EOS if h == 0 else ord(ALPHABET[h % len(ALPHABET)])
    if banned:
        i = h
        while token in banned:
            i += 1
            token = ord(ALPHABET[i % len(ALPHABET)])
    return token


def toy_logprob(context: list[int], token: int) -> float:
    """The toy model's log-probability of `token` after `context` (in [-10, 0))."""
    h = ((sum(context[-2:]) + 3 * token) * 2654435761) % 1000
    return -(h + 1) / 100.0


def render_chatml(messages: list[Any], add_generation_prompt: bool) -> str:
    """The stub's chat template (ChatML) over protocol `Message`s, as text."""
    text = "".join(f"{IM_START}{m.role}\n{m.content}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _encode_text(text: str) -> list[int]:
    return [ord(c) for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids if t != EOS)


class _Trie:
    """Prefix trie of computed sequences: the stub's 'radix cache'."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}

    def match(self, seq: list[int]) -> int:
        node, n = self.root, 0
        for t in seq:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, seq: list[int]) -> None:
        node = self.root
        for t in seq:
            node = node.setdefault(t, {})


@dataclass
class _Session:
    owner: bytes
    history: list[int]
    namespace: str | None = None
    open_assistant: bool = False
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Branch:
    index: int
    output: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    done: bool = False


@dataclass
class _Job:
    client: bytes
    msg: p.Generate
    prompt: list[int]
    cached: int
    branches: list[_Branch]
    session: _Session | None
    appended: int = 0
    next_at: float = 0.0


class StubServer:
    """A protocol-speaking toy engine in a background thread (see the module docstring)."""

    def __init__(self, endpoint: str | None = None, *, token_delay_s: float = 0.0,
                 record: bool = True) -> None:
        self._dir = None
        if endpoint is None:
            self._dir = tempfile.mkdtemp(prefix="radixlm-stub-")
            endpoint = f"ipc://{os.path.join(self._dir, 'stub.sock')}"
        self.endpoint = endpoint
        self.token_delay_s = token_delay_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._welcomed: set[bytes] = set()
        self._sessions: dict[str, _Session] = {}
        self._pins: dict[str, list[int]] = {}
        self._jobs: dict[tuple[bytes, str], _Job] = {}
        self._trie = _Trie()
        self._ids = itertools.count(1)
        self.record = record
        self.silent = False  # True: receive everything, answer nothing (a hung engine)
        # Observations for tests.
        self.received: list[p.Struct] = []
        self.max_running = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> StubServer:
        """Serve in a daemon thread (a context manager starts and stops it)."""
        self._thread = threading.Thread(target=self._serve, name="radixlm-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the socket, remove the private socket directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def sessions(self) -> int:
        """Sessions open now (every client's)."""
        return len(self._sessions)

    @property
    def running(self) -> int:
        """Generations in flight now."""
        return len(self._jobs)

    def received_of(self, kind: type) -> list[Any]:
        """The messages of type `kind` received so far (with ``record=True``)."""
        return [m for m in list(self.received) if isinstance(m, kind)]

    # -- the loop -------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            timeout = 5 if self._jobs else 50
            if poller.poll(timeout):
                while True:
                    try:
                        identity, data = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(identity, data)
            self._step()

    def _send(self, client: bytes, msg: p.Struct) -> None:
        self._sock.send_multipart([client, p.encode(msg)])

    def _error(self, client: bytes, rid: str | None, code: str, message: str) -> None:
        self._send(client, p.Error(rid=rid, code=code, message=message))

    def _handle(self, client: bytes, data: bytes) -> None:
        try:
            msg = p.decode_client(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._error(client, None, p.ErrorCode.BAD_MESSAGE, str(e))
            return
        if self.record:
            self.received.append(msg)
        if self.silent:
            return
        if isinstance(msg, p.Hello):
            if msg.protocol_version != p.PROTOCOL_VERSION:
                self._error(client, None, p.ErrorCode.UNSUPPORTED_VERSION, "version mismatch")
                return
            self._welcomed.add(client)
            self._send(client, p.Welcome(protocol_version=p.PROTOCOL_VERSION, server_version="stub",
                                       model="stub-toy", context_length=CONTEXT_LENGTH,
                                       page_size=1, kv_capacity=1 << 20))
            return
        if client not in self._welcomed:
            self._error(client, msg.rid, p.ErrorCode.HANDSHAKE_REQUIRED, "send hello first")
            return
        handler = {
            p.Generate: self._generate, p.Abort: self._abort, p.OpenSession: self._open,
            p.ForkSession: self._fork, p.TruncateSession: self._truncate,
            p.CloseSession: self._close, p.Pin: self._pin, p.Unpin: self._unpin,
            p.ListSessions: self._list, p.GetStats: self._stats, p.FlushCache: self._flush,
            p.Tokenize: self._tokenize,
        }[type(msg)]
        try:
            handler(client, msg)
        except _Refused as e:
            self._error(client, msg.rid, e.code, e.message)

    # -- inputs ---------------------------------------------------------------------------

    def _ids_of(self, inp: p.Input, session: _Session | None) -> list[int]:
        given = [x for x in (inp.text, inp.input_ids, inp.messages) if x is not None]
        if len(given) != 1:
            raise _Refused(p.ErrorCode.INVALID_PARAMS, "input needs exactly one of text, "
                                                     "input_ids, messages")
        if inp.input_ids is not None:
            return list(inp.input_ids)
        if inp.text is not None:
            return _encode_text(inp.text)
        assert inp.messages is not None
        text = render_chatml(inp.messages, inp.add_generation_prompt)
        if session is not None and session.open_assistant and session.history:
            text = f"{IM_END}\n" + text
        return _encode_text(text)

    def _owned(self, client: bytes, sid: str) -> _Session:
        s = self._sessions.get(sid)
        if s is None or s.owner != client:
            raise _Refused(p.ErrorCode.NOT_FOUND, f"no session {sid!r}")
        return s

    def _new_session(self, client: bytes, history: list[int], namespace: str | None,
                     open_assistant: bool = False) -> str:
        sid = f"s{next(self._ids)}"
        self._sessions[sid] = _Session(client, list(history), namespace, open_assistant)
        return sid

    def _compute(self, seq: list[int]) -> int:
        """'Prefill' `seq`: how much was cached; the sequence joins the trie."""
        cached = self._trie.match(seq)
        self._trie.insert(seq)
        self.prompt_tokens_total += len(seq)
        self.cached_tokens_total += cached
        return cached

    # -- generation -----------------------------------------------------------------------

    def _generate(self, client: bytes, msg: p.Generate) -> None:
        if (client, msg.rid) in self._jobs:
            raise _Refused(p.ErrorCode.DUPLICATE_ID, f"rid {msg.rid!r} in flight")
        if not 1 <= msg.n <= p.MAX_N:
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"n must be in [1, {p.MAX_N}], got {msg.n}")
        sp = msg.sampling
        if (sp.max_tokens is not None and sp.max_tokens < 0) or sp.temperature < 0 or not 0 < sp.top_p <= 1:
            raise _Refused(p.ErrorCode.INVALID_PARAMS, "bad sampling parameters")
        if not 0 <= sp.top_logprobs <= p.MAX_TOP_LOGPROBS:
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"top_logprobs must be in [0, {p.MAX_TOP_LOGPROBS}]")
        session = self._owned(client, msg.session) if msg.session is not None else None
        if session is not None and session.busy:
            raise _Refused(p.ErrorCode.BUSY, f"session {msg.session!r} is busy")
        appended = self._ids_of(msg.input, session)
        prompt = (session.history if session is not None else []) + appended
        if not prompt:
            raise _Refused(p.ErrorCode.EMPTY_PROMPT, "the prompt is empty")
        if sp.max_tokens is None:  # what is left of the context
            sp = msgspec.structs.replace(sp, max_tokens=max(1, CONTEXT_LENGTH - len(prompt)))
        if len(prompt) + sp.max_tokens > CONTEXT_LENGTH:
            raise _Refused(p.ErrorCode.TOO_LONG, "prompt + max_tokens exceeds the context")
        start = msg.prompt_logprobs_start
        history = len(prompt) - len(appended)
        if start is not None and not -history <= start <= len(appended):
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"prompt_logprobs_start ({start}) must be in [{-history}, "
                           f"{len(appended)}]")
        if not 0 <= sp.min_tokens <= sp.max_tokens:
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"min_tokens must be in [0, max_tokens], got {sp.min_tokens}")
        for pattern in sp.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise _Refused(p.ErrorCode.INVALID_PARAMS,
                               f"stop_regex {pattern!r} is not a valid regex: {e}") from None
        cached = self._compute(prompt)
        if session is not None:
            session.busy = True
            if msg.input.messages is not None:
                session.open_assistant = msg.input.add_generation_prompt
        if sp is not msg.sampling:
            msg = msgspec.structs.replace(msg, sampling=sp)
        job = _Job(client, msg, prompt, cached, [_Branch(i) for i in range(msg.n)], session,
                   appended=len(appended), next_at=time.monotonic() + self.token_delay_s)
        self._jobs[(client, msg.rid)] = job
        self.max_running = max(self.max_running, len(self._jobs))
        if self.token_delay_s == 0:
            self._run_job(job, until_done=True)

    def _step(self) -> None:
        now = time.monotonic()
        for job in list(self._jobs.values()):
            if job.next_at <= now:
                self._run_job(job, until_done=False)
                job.next_at = now + self.token_delay_s

    def _run_job(self, job: _Job, *, until_done: bool) -> None:
        sp = job.msg.sampling
        enders = ()
        if sp.min_tokens:  # masked until min_tokens: EOS (unless ignored) and stop ids
            enders = set(sp.stop_token_ids) if sp.ignore_eos else {EOS, *sp.stop_token_ids}
        for b in job.branches:
            while not b.done:
                if len(b.output) >= sp.max_tokens:
                    self._finish(job, b, "length", None)
                    break
                shift = (sp.seed or 0) + b.index if sp.temperature > 0 else 0
                banned = enders if enders and len(b.output) < sp.min_tokens else ()
                token = toy_next_token(job.prompt + b.output, shift, banned)
                b.output.append(token)
                self.generated_tokens_total += 1
                if token == EOS and not sp.ignore_eos:
                    self._finish(job, b, "stop", EOS)
                    break
                if token in sp.stop_token_ids:  # its text is not output (as SGLang trims it)
                    self._finish(job, b, "stop", token)
                    break
                b.text += _decode([token])
                hit = next((s for s in sp.stop if s in b.text), None)
                if hit is not None:
                    b.text = b.text[: b.text.index(hit)]
                    b.output = _encode_text(b.text)
                    self._finish(job, b, "stop", hit)
                    break
                pattern = sp.stop_regex and next(
                    (r for r in sp.stop_regex if re.search(r, b.text)), None)
                if pattern:
                    # SGLang's trim: at the pattern's text, if it occurs literally; a match
                    # of anything else stays in the output.
                    cut = b.text.find(pattern)
                    if cut != -1:
                        b.text = b.text[:cut]
                        b.output = _encode_text(b.text)
                    elif job.msg.stream:
                        self._chunk(job, b, [token])
                    self._finish(job, b, "stop", pattern)
                    break
                if job.msg.stream:
                    self._chunk(job, b, [token])
                if not until_done:
                    break
        if all(b.done for b in job.branches):
            self._jobs.pop((job.client, job.msg.rid), None)

    def _chunk(self, job: _Job, b: _Branch, tokens: list[int]) -> None:
        logprobs = None
        if job.msg.sampling.logprobs:
            start = len(b.output) - len(tokens)
            logprobs = [toy_logprob(job.prompt + b.output[: start + i], t)
                        for i, t in enumerate(tokens)]
        texts = {t: _decode([t]) for t in tokens} if job.msg.logprob_texts else None
        self._send(job.client, p.Chunk(rid=job.msg.rid, text=_decode(tokens), token_ids=tokens,
                                       logprobs=logprobs, index=b.index, token_texts=texts))

    def _finish(self, job: _Job, b: _Branch, reason: str, matched: str | int | None) -> None:
        b.done = True
        msg = job.msg
        if all(x.done for x in job.branches):  # not running once its last p.Done is out
            self._jobs.pop((job.client, msg.rid), None)
        session_id, length = None, None
        if job.session is not None:
            out = b.output if reason != "abort" else []
            if msg.n == 1:
                session_id = msg.session
                job.session.history = job.prompt + out
                job.session.busy = False
                length = len(job.session.history)
            else:
                session_id = self._new_session(job.client, job.prompt + out,
                                               job.session.namespace, job.session.open_assistant)
                length = len(job.prompt + out)
                if all(x.done for x in job.branches):
                    job.session.history = list(job.prompt)
                    job.session.busy = False
        self._trie.insert(job.prompt + b.output)
        prompt_logprobs = prompt_ids = None
        if msg.prompt_logprobs_start is not None:  # from the appended input (< 0: history)
            seq = job.prompt
            start = len(seq) - job.appended + msg.prompt_logprobs_start
            positions = range(max(1, start), len(seq))
            prompt_logprobs = [toy_logprob(seq[:i], seq[i]) for i in positions]
            prompt_ids = [seq[i] for i in positions]
        texts = None
        if msg.logprob_texts:  # a toy token's text is its character
            texts = {t: _decode([t]) for t in (*b.output, *(prompt_ids or ()))}
        self._send(job.client, p.Done(
            rid=msg.rid, finish_reason=reason, text=b.text, token_ids=list(b.output),  # type: ignore[arg-type]
            usage=p.Usage(prompt_tokens=len(job.prompt), cached_tokens=job.cached,
                        completion_tokens=len(b.output)),
            matched_stop=matched, prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_ids,
            logprobs=[toy_logprob(job.prompt + b.output[:i], t) for i, t in enumerate(b.output)]
            if msg.sampling.logprobs else None,
            session=session_id, session_length=length, index=b.index, token_texts=texts,
        ))

    def _abort(self, client: bytes, msg: p.Abort) -> None:
        job = self._jobs.pop((client, msg.rid), None)
        if job is None:
            raise _Refused(p.ErrorCode.NOT_FOUND, f"no request {msg.rid!r} in flight")
        for b in job.branches:
            if not b.done:
                self._finish(job, b, "abort", None)
        if job.session is not None:
            job.session.busy = False

    # -- sessions, pins, misc -------------------------------------------------------------

    def _open(self, client: bytes, msg: p.OpenSession) -> None:
        start: list[int] = []
        if msg.pinned is not None:
            if msg.pinned not in self._pins:
                raise _Refused(p.ErrorCode.NOT_FOUND, f"no pin {msg.pinned!r}")
            start = list(self._pins[msg.pinned])
        probe = _Session(client, start)
        ids = start + (self._ids_of(msg.input, probe if start else None) if msg.input else [])
        cached = self._compute(ids) if ids else 0
        open_assistant = bool(msg.input and msg.input.messages is not None
                              and msg.input.add_generation_prompt)
        sid = self._new_session(client, ids, msg.namespace, open_assistant)
        self._send(client, p.SessionOpened(rid=msg.rid, session=sid, length=len(ids),
                                         cached_tokens=cached))

    def _fork(self, client: bytes, msg: p.ForkSession) -> None:
        s = self._owned(client, msg.session)
        if s.busy:
            raise _Refused(p.ErrorCode.BUSY, f"session {msg.session!r} is busy")
        if not 1 <= msg.n <= p.MAX_FORK:
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"n must be in [1, {p.MAX_FORK}], got {msg.n}")
        ids = [self._new_session(client, s.history, s.namespace, s.open_assistant)
               for _ in range(msg.n)]
        self._send(client, p.SessionsForked(rid=msg.rid, sessions=ids, length=len(s.history)))

    def _truncate(self, client: bytes, msg: p.TruncateSession) -> None:
        s = self._owned(client, msg.session)
        if s.busy:
            raise _Refused(p.ErrorCode.BUSY, f"session {msg.session!r} is busy")
        if not 0 <= msg.length <= len(s.history):
            raise _Refused(p.ErrorCode.INVALID_PARAMS, "length out of range")
        s.history = s.history[: msg.length]
        self._send(client, p.Ok(rid=msg.rid))

    def _close(self, client: bytes, msg: p.CloseSession) -> None:
        ids = msg.ids()
        if not 1 <= len(ids) <= p.MAX_CLOSE:
            raise _Refused(p.ErrorCode.INVALID_PARAMS,
                           f"close_session names 1 to {p.MAX_CLOSE} sessions, got {len(ids)}")
        for session in ids:  # like the engine: close what can be, refuse with the first error
            s = self._owned(client, session)
            if s.busy:
                raise _Refused(p.ErrorCode.BUSY, f"session {session!r} is busy")
            del self._sessions[session]
        self._send(client, p.Ok(rid=msg.rid))

    def _pin(self, client: bytes, msg: p.Pin) -> None:
        if msg.name in self._pins:
            raise _Refused(p.ErrorCode.DUPLICATE_ID, f"pin {msg.name!r} exists")
        ids = self._ids_of(msg.input, None)
        self._compute(ids)
        self._pins[msg.name] = ids
        self._send(client, p.Pinned(rid=msg.rid, name=msg.name, length=len(ids)))

    def _unpin(self, client: bytes, msg: p.Unpin) -> None:
        if self._pins.pop(msg.name, None) is None:
            raise _Refused(p.ErrorCode.NOT_FOUND, f"no pin {msg.name!r}")
        self._send(client, p.Ok(rid=msg.rid))

    def _list(self, client: bytes, msg: p.ListSessions) -> None:
        now = time.monotonic()
        infos = [p.SessionInfo(session=sid, length=len(s.history), idle_s=now - s.last_used,
                             retention="hard", busy=s.busy, namespace=s.namespace)
                 for sid, s in self._sessions.items() if s.owner == client]
        self._send(client, p.SessionList(rid=msg.rid, sessions=infos))

    def _stats(self, client: bytes, msg: p.GetStats) -> None:
        total = self.prompt_tokens_total
        self._send(client, p.StatsReply(
            rid=msg.rid, capacity=1 << 20, free=1 << 20, evictable=0, protected=0, private=0,
            retained_tokens={}, retained_cap=0, host_capacity=0, host_used=0,
            sessions=len(self._sessions), pins=len(self._pins), running=len(self._jobs),
            waiting=0, prompt_tokens_total=total, cached_tokens_total=self.cached_tokens_total,
            hit_rate=self.cached_tokens_total / total if total else 0.0, invariant_ok=True,
            generated_tokens_total=self.generated_tokens_total, retractions=0,
            fair_preemptions=0, capped_steps=0, finish_reasons={}, latency={},
        ))

    def _flush(self, client: bytes, msg: p.FlushCache) -> None:
        self._trie = _Trie()
        self._send(client, p.Ok(rid=msg.rid))

    def _tokenize(self, client: bytes, msg: p.Tokenize) -> None:
        self._send(client, p.Tokens(rid=msg.rid, input_ids=self._ids_of(msg.input, None)))


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixlm.testing",
                                     description="Serve the toy protocol stub until killed.")
    parser.add_argument("--endpoint", required=True, help="ipc:// or tcp:// endpoint to bind")
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="seconds per generated token (default: %(default)s)")
    args = parser.parse_args(argv)
    stub = StubServer(args.endpoint, token_delay_s=args.token_delay, record=False)
    print(f"stub serving at {stub.endpoint}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stub._serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
