"""`StubServer`: the stub's socket, its serving loop and handshake, and where each client
message goes -- session and pin messages to `SessionMessages`, Generate and Abort to
`GenerationMessages`; stats, flush and tokenize are answered here. See `radixlm.testing`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as p
from radixlm.testing.stub_generation import GenerationMessages
from radixlm.testing.stub_sessions import SessionMessages
from radixlm.testing.stub_state import PrefixTrie, Refused, StubState
from radixlm.testing.toy_model import CONTEXT_LENGTH

__all__ = ["StubServer"]


class StubServer:
    """A protocol-speaking toy engine in a background thread (see `radixlm.testing`)."""

    def __init__(self, endpoint: str | None = None, *, token_delay_s: float = 0.0,
                 record: bool = True) -> None:
        self._dir = None
        if endpoint is None:
            self._dir = tempfile.mkdtemp(prefix="radixlm-stub-")
            endpoint = f"ipc://{os.path.join(self._dir, 'stub.sock')}"
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._welcomed: set[bytes] = set()
        self._state = StubState()
        self._generation = GenerationMessages(self._state, self._send, token_delay_s)
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            **SessionMessages(self._state, self._send).handlers(),
            **self._generation.handlers(),
            p.GetStats: self._stats, p.FlushCache: self._flush, p.Tokenize: self._tokenize,
        }
        self.record = record
        self.silent = False  # True: receive everything, answer nothing (a hung engine)
        self.received: list[p.Struct] = []  # every message, with `record`

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> StubServer:
        """Serve in a daemon thread (a context manager starts and stops it)."""
        self._thread = threading.Thread(target=self.serve, name="radixlm-stub", daemon=True)
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
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observations for tests -----------------------------------------------------------

    @property
    def token_delay_s(self) -> float:
        """Seconds per generated token per branch (0: every generation at once)."""
        return self._generation.token_delay_s

    @token_delay_s.setter
    def token_delay_s(self, value: float) -> None:
        self._generation.token_delay_s = value

    @property
    def sessions(self) -> int:
        """Sessions open now (every client's)."""
        return len(self._state.sessions)

    @property
    def running(self) -> int:
        """Generations in flight now."""
        return len(self._generation.jobs)

    @property
    def max_running(self) -> int:
        """The most generations that were in flight at once."""
        return self._generation.max_running

    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens of every request so far (cached ones included)."""
        return self._state.prompt_tokens_total

    @property
    def cached_tokens_total(self) -> int:
        """Of those, the tokens the prefix trie held already."""
        return self._state.cached_tokens_total

    @property
    def generated_tokens_total(self) -> int:
        """Tokens generated so far, every branch's."""
        return self._generation.generated_tokens_total

    def received_of(self, kind: type) -> list[Any]:
        """The messages of type `kind` received so far (with ``record=True``)."""
        return [m for m in list(self.received) if isinstance(m, kind)]

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer messages (and pace generations) until stopped."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        generation = self._generation
        while not self._stop.is_set():
            timeout = 5 if generation.jobs else 50
            if poller.poll(timeout):
                while True:
                    try:
                        identity, data = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(identity, data)
            generation.step()

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
            self._hello(client, msg)
            return
        if client not in self._welcomed:
            self._error(client, msg.rid, p.ErrorCode.HANDSHAKE_REQUIRED, "send hello first")
            return
        try:
            self._handlers[type(msg)](client, msg)
        except Refused as e:
            self._error(client, msg.rid, e.code, e.message)

    def _hello(self, client: bytes, msg: p.Hello) -> None:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            self._error(client, None, p.ErrorCode.UNSUPPORTED_VERSION, "version mismatch")
            return
        self._welcomed.add(client)
        self._send(client, p.Welcome(protocol_version=p.PROTOCOL_VERSION, server_version="stub",
                                     model="stub-toy", context_length=CONTEXT_LENGTH,
                                     page_size=1, kv_capacity=1 << 20))

    # -- the engine's own messages ----------------------------------------------------------

    def _stats(self, client: bytes, msg: p.GetStats) -> None:
        state = self._state
        total = state.prompt_tokens_total
        self._send(client, p.StatsReply(
            rid=msg.rid, capacity=1 << 20, free=1 << 20, evictable=0, protected=0, private=0,
            retained_tokens={}, retained_cap=0, host_capacity=0, host_used=0,
            sessions=len(state.sessions), pins=len(state.pins), running=self.running,
            waiting=0, prompt_tokens_total=total, cached_tokens_total=state.cached_tokens_total,
            hit_rate=state.cached_tokens_total / total if total else 0.0, invariant_ok=True,
            generated_tokens_total=self.generated_tokens_total, retractions=0,
            fair_preemptions=0, capped_steps=0, finish_reasons={}, latency={},
        ))

    def _flush(self, client: bytes, msg: p.FlushCache) -> None:
        self._state.trie = PrefixTrie()
        self._send(client, p.Ok(rid=msg.rid))

    def _tokenize(self, client: bytes, msg: p.Tokenize) -> None:
        self._send(client, p.Tokens(rid=msg.rid, input_ids=self._state.ids_of(msg.input, None)))
