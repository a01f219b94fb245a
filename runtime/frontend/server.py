"""The frontend's message loop: clients on a ROUTER, the engine on two PUSH/PULL pipes.

One thread owns every socket and all state; tokenization of large inputs runs in a small
thread pool and comes back through a wake-up pipe, so forwarding the engine's outputs to
clients never waits for it. The engine never waits on the frontend (its PUSH pipe is
unbounded) and the frontend never waits on a client (sends are non-blocking; a client's
ROUTER queue is unbounded, so a client that stops reading costs frontend memory, not
other clients' latency).

Message handling, in order of arrival per client (see clients.py for the queue):
- decode (frames.py): not msgpack / not a valid message -> bad_message, an unknown
  ``"type"`` -> unknown_type; anything but Hello before the handshake ->
  handshake_required; Hello with another version -> unsupported_version, else Welcome;
- requests are checked (the rules of runtime/rules.py that need no engine state),
  tokenized (prepare.py), then forwarded as
  `EngineGenerate` / `EngineOpenSession` / `EnginePin` / `EngineAbort` / `EngineCommand`;
  `Tokenize` is answered here;
- `StepOutputs` become Chunks and Dones (streams.py); `ToClient` replies are forwarded,
  read only for liveness bookkeeping and a tenant's names (one that ends a Generate says
  so in `ends`). The frontend keeps no record of sessions: the engine owns histories and
  ends every turn; an append is rendered for each way its history may end and the
  engine picks (prepare.py).

Client disconnects are seen two ways: a send to a vanished client fails
(``ROUTER_MANDATORY`` -> EHOSTUNREACH), and the socket monitor reports a closed
connection even for an idle client (clients.py). Either way the frontend forgets the
client and sends `ClientGone` so the engine aborts its requests, frees their private KV
and closes its sessions.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import msgspec
import zmq
from radixlm.runtime import channel
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine_wire import (
    AppendVariants,
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
    EngineReady,
    StepOutputs,
    ToClient,
    ToEngine,
    TokenOutput,
    to_frontend_decoder,
)
from radixlm.runtime.frontend.clients import ClientRegistry, ClientState, Pending
from radixlm.runtime.frontend.frames import FrameError, decode_frame
from radixlm.runtime.frontend.liveness import PROBE_CLIENT, Change, EngineWatch
from radixlm.runtime.frontend.prepare import (
    TextModel,
    assistant_flag,
    generate_ids,
    input_ids,
    open_session_ids,
    pin_ids,
)
from radixlm.runtime.frontend.streams import RequestStream
from radixlm.runtime.frontend.structured import plan_structured
from radixlm.runtime.frontend.tenants import names_for
from radixlm.runtime.protocol import PROTOCOL_VERSION
from radixlm.runtime.rules import (
    RequestError,
    check_close,
    check_fork,
    check_generate,
    check_input,
    check_input_size,
    check_pin_name,
)
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("radixlm.frontend")

# Inputs up to this many characters are tokenized on the main thread (a thread hop costs
# more than encoding them: well under a millisecond); larger ones go to the worker pool.
INLINE_PREPARE_CHARS = 1024
# Messages taken from one socket per loop turn, so no source starves the others.
BATCH = 256

_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK


def welcome_from(ready: EngineReady, server_version: str, max_message_bytes: int = 0) -> wire.Welcome:
    return wire.Welcome(
        protocol_version=PROTOCOL_VERSION, server_version=server_version, model=ready.model,
        context_length=ready.context_length, page_size=ready.page_size,
        kv_capacity=ready.kv_capacity, max_message_bytes=max_message_bytes,
    )


def _input_chars(inp: wire.Input | None) -> int:
    if inp is None:
        return 0
    if inp.text is not None:
        return len(inp.text)
    if inp.messages is not None:
        return sum(len(m.content or "") for m in inp.messages)
    return 0


def _command_rid(msg: ToEngine) -> str | None:
    """The rid of a message the engine answers with one reply (not a Generate's)."""
    if isinstance(msg, EngineCommand):
        return msg.msg.rid
    if isinstance(msg, (EngineOpenSession, EnginePin)):
        return msg.rid
    return None


def _done_future(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _run_job(job: Callable[[], Any]) -> Any:
    """A preparation job's result, or the RequestError it raised (never raises)."""
    try:
        return job()
    except RequestError as e:
        return e
    except Exception as e:  # a bug or a tokenizer failure: an error reply, not a dead loop
        log.exception("preparing a request failed")
        return RequestError(wire.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")


class Frontend:
    """All frontend state and handlers; `serve` runs the loop. Main thread only, except
    the jobs handed to `executor`."""

    def __init__(self, *, model: TextModel, welcome: wire.Welcome, clients: zmq.Socket[Any],
                 monitor: zmq.Socket[Any], from_engine: zmq.Socket[Any],
                 to_engine: zmq.Socket[Any], executor: Executor,
                 engine_timeout_s: float = 60.0, multi_tenant: bool = False,
                 max_inflight: int = 0, max_priority: int | None = None) -> None:
        self.model = model
        self._max_inflight = max_inflight  # per client; 0 = no cap
        self._max_priority = max_priority  # None = as asked
        self._multi_tenant = multi_tenant  # clients authenticate: each key is a tenant
        self._watch = EngineWatch(engine_timeout_s, time.monotonic())
        self._welcome = wire.encode(welcome)
        self._encode_reply = msgspec.msgpack.Encoder().encode  # the chunk path's own encoder
        self._sock = clients
        self._monitor = monitor
        self._from_engine = from_engine
        self._to_engine_sock = to_engine
        self._executor = executor
        self._keys = itertools.count(1)
        self._streams: dict[int, RequestStream] = {}
        self._clients = ClientRegistry()
        self._woken: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._handlers: dict[type, Callable[[ClientState, Any], None]] = {
            wire.Generate: self._generate,
            wire.Abort: self._abort,
            wire.Tokenize: self._tokenize,
            wire.OpenSession: self._open_session,
            wire.Pin: self._pin,
            wire.ForkSession: self._fork_session,
            wire.TruncateSession: self._command,  # its length is the engine's to judge
            wire.CloseSession: self._close_session,
            wire.Unpin: self._unpin,
            wire.ListSessions: self._command,
            wire.GetStats: self._command,
            wire.FlushCache: self._flush_cache,
        }

    # -- loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until interrupted (SIGTERM / KeyboardInterrupt propagate)."""
        poller = zmq.Poller()
        poller.register(self._from_engine, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        poll_ms = int(self._watch.interval_s * 1000)
        while True:
            ready = dict(poller.poll(poll_ms))
            self._watch_engine()
            if self._from_engine in ready:
                self._drain_engine()
            if self._monitor in ready:
                self._drain_monitor()
            if self._wake_r in ready:
                self._drain_wakes()
            if self._sock in ready:
                self._drain_clients()

    @property
    def wakeup_fd(self) -> int:
        """Writing a byte here wakes the loop (worker threads do; signal.set_wakeup_fd may)."""
        return self._wake_w

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain_engine(self) -> None:
        if self._watch.on_message(time.monotonic()) is Change.UP:
            log.warning("the engine answers again")
        for msg in channel.drain(self._from_engine, to_frontend_decoder, BATCH, log):
            self.on_engine_message(msg)

    # -- engine liveness -------------------------------------------------------------------

    def _watch_engine(self) -> None:
        now = time.monotonic()
        rid = self._watch.probe_due(now)
        if rid is not None:
            channel.send(self._to_engine_sock, EngineCommand(client=PROBE_CLIENT,
                                                             msg=wire.GetStats(rid=rid)))
        if self._watch.check(now) is Change.DOWN:
            self._engine_down(now)

    def _unavailable(self) -> str:
        return (f"the engine process has not answered for "
                f"{self._watch.silent_for(time.monotonic()):.0f} s (stopped, frozen or stuck; "
                f"--engine-timeout {self._watch.timeout_s:g} s)")

    def _engine_down(self, now: float) -> None:
        """Fail every request waiting on the engine. It is told to abort the generations,
        in case it comes back; late replies to the failed commands (each gets exactly one)
        are dropped."""
        message = self._unavailable()
        failed = 0
        for client in self._clients:
            for rid, key in list(client.inflight.items()):
                stream = self._streams.get(key)
                if stream is not None:
                    self._end_request(stream)
                self._to_engine(None, EngineAbort(key=key))
                self._error(client, rid, wire.ErrorCode.ENGINE_UNAVAILABLE, message)
                failed += 1
            for rid in client.awaiting:
                client.abandoned.add(rid)
                self._error(client, rid, wire.ErrorCode.ENGINE_UNAVAILABLE, message)
                failed += 1
            client.awaiting.clear()
        log.error("%s: %d request(s) failed with engine_unavailable", message, failed)

    def _drain_clients(self) -> None:
        for _ in range(BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.on_client_frames(frames)

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                identity = self._clients.on_fd(event["value"])
                if identity is not None:
                    self._client_gone(identity, "disconnected")

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 65536)
        while True:
            try:
                identity = self._woken.get_nowait()
            except queue.Empty:
                return
            client = self._clients.get(identity)
            if client is not None:
                self._run_pending(client)

    # -- sending ---------------------------------------------------------------------------

    def _send(self, identity: bytes, data: bytes) -> bool:
        """Send an encoded reply; False (and the client is forgotten) if it is gone.

        Two `send` calls rather than `send_multipart` (channel.send): this runs once per
        streamed chunk, and pyzmq's send_multipart costs several microseconds more in
        Python. A vanished client fails on the identity frame, before anything is queued.
        """
        sock = self._sock
        try:
            sock.send(identity, _SEND_MORE)
            sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._client_gone(identity, "unreachable")
            return False

    def _reply(self, client: ClientState, msg: msgspec.Struct) -> bool:
        return self._send(client.identity, wire.encode(msg))

    def _error(self, client: ClientState, rid: str | None, code: str, message: str) -> None:
        log.debug("error %s for %r: %s", code, rid, message)
        self._reply(client, wire.Error(rid=rid, code=code, message=message))

    def _to_engine(self, client: ClientState | None, msg: ToEngine) -> None:
        if client is not None:
            client.touched_engine = True
            rid = _command_rid(msg)
            if rid is not None:
                client.awaiting.add(rid)
        channel.send(self._to_engine_sock, msg)

    # -- ordered preparation -------------------------------------------------------------

    def _enqueue(self, client: ClientState, job: Callable[[], Any] | None,
                 then: Callable[[Any], None], *, heavy: bool = False) -> None:
        """Run `job` (inline, or in the pool if `heavy`), then `then(result)` on this
        thread once every earlier item of this client has gone."""
        if heavy and job is not None:
            future = self._executor.submit(_run_job, job)
            identity = client.identity
            future.add_done_callback(lambda _f: self._wake(identity))
        else:
            future = _done_future(_run_job(job) if job is not None else None)
        client.pending.append(Pending(future, then))
        self._run_pending(client)

    def _wake(self, identity: bytes) -> None:  # worker thread
        self._woken.put(identity)
        with contextlib.suppress(BlockingIOError):  # full: wake-ups are pending already
            os.write(self._wake_w, b"\0")

    def _run_pending(self, client: ClientState) -> None:
        pending = client.pending
        while pending and pending[0].future.done():
            item = pending.popleft()
            item.then(item.future.result())
            if self._clients.get(client.identity) is not client:
                return  # it vanished while replying

    def _forward(self, client: ClientState, msg: ToEngine) -> None:
        """Send to the engine in the client's order."""
        self._enqueue(client, None, lambda _r: self._to_engine(client, msg))

    # -- client messages -------------------------------------------------------------------

    def on_client_frames(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        client = self._clients.get(identity) or self._register(identity, frames)
        if len(frames) != 2:
            self._error(client, None, wire.ErrorCode.BAD_MESSAGE,
                        f"a message is one frame, got {len(frames) - 1}")
            return
        msg = decode_frame(frames[1].bytes)
        if isinstance(msg, FrameError):
            self._error(client, msg.rid, msg.code, msg.message)
            return
        if isinstance(msg, wire.Hello):
            self._hello(client, msg)
            return
        if not client.welcomed:
            self._error(client, msg.rid, wire.ErrorCode.HANDSHAKE_REQUIRED,
                        f"send hello (protocol_version={PROTOCOL_VERSION}) first")
            return
        if self._watch.down and type(msg) is not wire.Tokenize:  # tokenize needs no engine
            self._error(client, msg.rid, wire.ErrorCode.ENGINE_UNAVAILABLE, self._unavailable())
            return
        try:
            self._handlers[type(msg)](client, msg)
        except RequestError as e:
            self._error(client, msg.rid, e.code, e.message)
        except Exception as e:  # a bug: answer it and keep serving everyone else
            log.exception("handling %s failed", type(msg).__name__)
            self._error(client, msg.rid, wire.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _register(self, identity: bytes, frames: list[zmq.Frame]) -> ClientState:
        frame = frames[0]
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = -1
        if fd >= 0 and self._clients.on_fd(fd) is not None:
            self._drain_monitor()  # the previous owner's disconnect is queued there
            stale = self._clients.on_fd(fd)
            if stale is not None:
                self._client_gone(stale, "its connection was replaced")
        return self._clients.add(identity, fd,
                                 names_for(frames[-1], multi_tenant=self._multi_tenant))

    def _hello(self, client: ClientState, msg: wire.Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._error(client, None, wire.ErrorCode.UNSUPPORTED_VERSION,
                        f"this server speaks protocol version {PROTOCOL_VERSION}, "
                        f"the client {msg.protocol_version}")
            return
        client.welcomed = True
        log.debug("client %s (%r) connected", client.identity.hex(), msg.client_name)
        self._send(client.identity, self._welcome)

    def _generate(self, client: ClientState, msg: wire.Generate) -> None:
        if msg.rid in client.inflight:
            raise RequestError(wire.ErrorCode.DUPLICATE_ID, f"request {msg.rid!r} is already in flight")
        if self._max_inflight and len(client.inflight) >= self._max_inflight:
            raise RequestError(wire.ErrorCode.CAPACITY,
                               f"this client has {len(client.inflight)} requests in flight, the "
                               f"server's cap (--max-inflight-per-client); wait for one to end")
        check_generate(msg, self.model.vocab_size)
        self._check_size(msg.input)
        plan = plan_structured(msg, self.model.tool_format)
        key = next(self._keys)
        stream = RequestStream(key, client.identity, msg.rid, stream=msg.stream, n=msg.n,
                               sampling=msg.sampling, session=msg.session,
                               tokenizer=self.model.tokenizer,
                               tool_calls=plan.tool_calls if plan.parse_calls else None)
        self._streams[key] = stream
        client.inflight[msg.rid] = key

        def then(prepared: tuple[list[int], AppendVariants | None] | RequestError) -> None:
            if isinstance(prepared, RequestError):
                self._end_request(stream)
                self._error(client, msg.rid, prepared.code, prepared.message)
                return
            ids, variants = prepared
            stream.prepared(ids)
            self._to_engine(client, EngineGenerate(
                key=key, client=client.identity, rid=msg.rid, input_ids=ids,
                sampling=msg.sampling, prompt_logprobs_start=msg.prompt_logprobs_start,
                priority=(msg.priority if self._max_priority is None
                          else min(msg.priority, self._max_priority)),
                session=msg.session, n=msg.n,
                namespace=(client.names.namespace(msg.namespace) if msg.session is None
                           else client.names.turn_namespace(msg.namespace)),
                grammar=plan.grammar,
                assistant_open=assistant_flag(msg.input) if msg.session is not None else None,
                variants=variants,
            ))

        model = self.model
        self._enqueue(client, lambda: generate_ids(model, msg), then,
                      heavy=_input_chars(msg.input) > INLINE_PREPARE_CHARS)

    def _check_size(self, inp: wire.Input | None) -> None:
        check_input_size(inp, self.model.max_input_bytes, self.model.context_length)

    def _abort(self, client: ClientState, msg: wire.Abort) -> None:
        key = client.inflight.get(msg.rid)
        if key is None:
            raise RequestError(wire.ErrorCode.NOT_FOUND, f"no request {msg.rid!r} in flight")
        self._forward(client, EngineAbort(key=key))

    def _tokenize(self, client: ClientState, msg: wire.Tokenize) -> None:
        check_input(msg.input, self.model.vocab_size)
        self._check_size(msg.input)

        def then(ids: list[int] | RequestError) -> None:
            if isinstance(ids, RequestError):
                self._error(client, msg.rid, ids.code, ids.message)
            else:
                self._reply(client, wire.Tokens(rid=msg.rid, input_ids=ids))

        model = self.model
        self._enqueue(client, lambda: input_ids(model, msg.input), then,
                      heavy=_input_chars(msg.input) > INLINE_PREPARE_CHARS)

    def _open_session(self, client: ClientState, msg: wire.OpenSession) -> None:
        if msg.input is not None:
            check_input(msg.input, self.model.vocab_size)
            self._check_size(msg.input)

        def then(ids: list[int] | RequestError) -> None:
            if isinstance(ids, RequestError):
                self._error(client, msg.rid, ids.code, ids.message)
                return
            self._to_engine(client, EngineOpenSession(
                client=client.identity, rid=msg.rid, input_ids=ids,
                pinned=client.names.pin(msg.pinned), retention=msg.retention, ttl_s=msg.ttl_s,
                namespace=client.names.namespace(msg.namespace),
                assistant_open=bool(assistant_flag(msg.input)),
            ))

        model = self.model
        self._enqueue(client, lambda: open_session_ids(model, msg), then,
                      heavy=_input_chars(msg.input) > INLINE_PREPARE_CHARS)

    def _pin(self, client: ClientState, msg: wire.Pin) -> None:
        check_pin_name(msg.name)
        check_input(msg.input, self.model.vocab_size)
        self._check_size(msg.input)

        def then(ids: list[int] | RequestError) -> None:
            if isinstance(ids, RequestError):
                self._error(client, msg.rid, ids.code, ids.message)
                return
            names = client.names
            self._to_engine(client, EnginePin(client=client.identity, rid=msg.rid,
                                              name=names.pin(msg.name) or "", input_ids=ids,
                                              namespace=names.namespace(msg.namespace)))

        model = self.model
        self._enqueue(client, lambda: pin_ids(model, msg), then,
                      heavy=_input_chars(msg.input) > INLINE_PREPARE_CHARS)

    def _fork_session(self, client: ClientState, msg: wire.ForkSession) -> None:
        check_fork(msg.n)
        self._command(client, msg)

    def _close_session(self, client: ClientState, msg: wire.CloseSession) -> None:
        check_close(msg)
        self._command(client, msg)

    def _unpin(self, client: ClientState, msg: wire.Unpin) -> None:
        self._command(client, wire.Unpin(rid=msg.rid, name=client.names.pin(msg.name) or ""))

    def _flush_cache(self, client: ClientState, msg: wire.FlushCache) -> None:
        # With several tenants the engine flushes only this client's tenant's namespaces.
        self._forward(client, EngineCommand(client=client.identity, msg=msg,
                                            tenant=client.names.tenant))

    def _command(self, client: ClientState, msg: Any) -> None:
        self._forward(client, EngineCommand(client=client.identity, msg=msg))

    # -- engine messages -------------------------------------------------------------------

    def on_engine_message(self, msg: StepOutputs | ToClient | EngineReady) -> None:
        if isinstance(msg, StepOutputs):
            self._on_step(msg.outputs)
        elif isinstance(msg, ToClient):
            self._on_reply(msg)
        else:
            log.warning("unexpected EngineReady while serving (engine restarted?)")

    def _on_step(self, outputs: list[TokenOutput]) -> None:
        """One scheduler step's outputs. The common case (a streamed token of a running
        request) is handled inline: this loop runs once per token of every request."""
        streams = self._streams
        encode_reply = self._encode_reply
        send = self._send
        for out in outputs:
            stream = streams.get(out.key)
            if stream is None:
                continue  # its client is gone (or an error already ended it)
            try:
                if out.finish_reason is None:
                    chunk = stream.on_output(out).chunk
                    if chunk is not None:
                        send(stream.client, encode_reply(chunk))
                else:
                    self._on_last_output(stream, out)
            except Exception as e:  # a bug: fail this request, keep serving the rest
                log.exception("output of request key %d failed", out.key)
                self._fail_request(out.key, f"{type(e).__name__}: {e}")

    def _on_last_output(self, stream: RequestStream, out: TokenOutput) -> None:
        """The output that ends a branch: its last chunk and its Done."""
        if out.finish_reason == "error":  # the engine sent the client an Error for it
            self._end_request(stream)
            return
        chunk, done = stream.on_output(out)
        if chunk is not None and not self._send(stream.client, wire.encode(chunk)):
            return
        if done is not None:
            if not self._send(stream.client, wire.encode(done)):
                return
            if stream.remaining == 0:
                self._end_request(stream)

    def _fail_request(self, key: int, message: str) -> None:
        stream = self._streams.get(key)
        if stream is None:
            return
        self._end_request(stream)
        self._to_engine(None, EngineAbort(key=key))
        client = self._clients.get(stream.client)
        if client is not None:
            self._error(client, stream.rid, wire.ErrorCode.INTERNAL, message)

    def _end_request(self, stream: RequestStream) -> None:
        self._streams.pop(stream.key, None)
        client = self._clients.get(stream.client)
        if client is not None and client.inflight.get(stream.rid) == stream.key:
            del client.inflight[stream.rid]

    def _on_reply(self, msg: ToClient) -> None:
        client = self._clients.get(msg.client)
        if client is None:
            return  # gone (or a liveness probe's reply); the engine has been told
        if msg.ends is not None:  # the engine refused or failed a Generate (session busy, ...)
            stream = self._streams.get(msg.ends)
            if stream is not None and stream.client == msg.client:
                self._end_request(stream)
        try:
            reply = wire.decode_server(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("engine sent an undecodable reply: %r", msg.data[:200])
            return
        rid = getattr(reply, "rid", None)
        if rid is not None:
            if client.abandoned and rid in client.abandoned:
                client.abandoned.discard(rid)  # already failed as engine_unavailable
                return
            client.awaiting.discard(rid)
        outer = self._in_tenant_terms(client, reply)
        self._send(msg.client, msg.data if outer is None else wire.encode(outer))

    def _in_tenant_terms(self, client: ClientState, reply: wire.ServerMessage) -> wire.ServerMessage | None:
        """The reply as the client may see it (None: as it is): the engine's names for
        its namespaces and pins put back, other tenants' sessions left out, activity
        counters of a shared server hidden."""
        names = client.names
        if names.tenant is None:
            return None
        if isinstance(reply, wire.Error):
            message = names.scrub(reply.message)
            return None if message == reply.message else msgspec.structs.replace(reply, message=message)
        if isinstance(reply, wire.SessionList):
            return names.sessions(reply)
        if isinstance(reply, wire.Pinned):
            return names.pinned(reply)
        if isinstance(reply, wire.StatsReply):
            return msgspec.structs.replace(
                reply, sessions=0, pins=0, retained_tokens={}, prompt_tokens_total=0,
                cached_tokens_total=0, hit_rate=0.0, generated_tokens_total=0, retractions=0,
                fair_preemptions=0, capped_steps=0)
        return None

    # -- disconnects -----------------------------------------------------------------------

    def _client_gone(self, identity: bytes, why: str) -> None:
        client = self._clients.remove(identity)
        if client is None:
            return
        for key in client.inflight.values():
            self._streams.pop(key, None)
        client.pending.clear()  # queued work of a gone client never runs
        log.log(logging.INFO if client.inflight else logging.DEBUG,
                "client %s %s: %d request(s) aborted", identity.hex(), why, len(client.inflight))
        if client.touched_engine:
            self._to_engine(None, ClientGone(client=identity))
