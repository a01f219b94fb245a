"""Client requests: checked, prepared (tokenized) in each client's order, then forwarded
to the engine as `EngineGenerate` / `EngineOpenSession` / `EnginePin` / `EngineAbort` /
`EngineCommand`; `Tokenize` and `Detokenize` are answered here.

The checks are the rules of runtime/rules.py a message alone decides (the engine checks
the rest). A handler raises `RequestError` for a refusal (the loop answers it); a
refusal found while preparing is answered in the client's order.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from radixlm.runtime import protocol as wire
from radixlm.runtime.engine.wire import (
    AppendVariants,
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
    ToEngine,
)
from radixlm.runtime.frontend.clients import ClientState, Routes
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
from radixlm.runtime.rules import (
    RequestError,
    check_close,
    check_fork,
    check_generate,
    check_input,
    check_input_size,
    check_pin_name,
    check_tools,
)

# Inputs up to this many characters are tokenized on the main thread (a thread hop costs
# more than encoding them: well under a millisecond); larger ones go to the worker pool.
INLINE_PREPARE_CHARS = 1024

# `enqueue(client, job, then, heavy=...)`: run `job` (in the pool if heavy), then
# `then(result or RequestError)` on the main thread once the client's earlier items went.
Enqueue = Callable[..., None]


def _input_chars(inp: wire.Input | None) -> int:
    if inp is None:
        return 0
    if inp.text is not None:
        return len(inp.text)
    if inp.messages is not None:
        return sum(len(m.content or "") for m in inp.messages)
    return 0


class ClientRequests:
    """The handler of each client message type (`handlers`)."""

    def __init__(self, routes: Routes, model: TextModel, enqueue: Enqueue, *,
                 max_inflight: int = 0, max_priority: int | None = None) -> None:
        self.routes = routes
        self.model = model
        self._enqueue = enqueue
        self._max_inflight = max_inflight  # per client; 0 = no cap
        self._max_priority = max_priority  # None = as asked
        self._keys = itertools.count(1)
        self.handlers: dict[type, Callable[[ClientState, Any], None]] = {
            wire.Generate: self.generate,
            wire.Abort: self.abort,
            wire.Tokenize: self.tokenize,
            wire.Detokenize: self.detokenize,
            wire.OpenSession: self.open_session,
            wire.Pin: self.pin,
            wire.ForkSession: self.fork_session,
            wire.TruncateSession: self.command,  # its length is the engine's to judge
            wire.CloseSession: self.close_session,
            wire.Unpin: self.unpin,
            wire.ListSessions: self.command,
            wire.ResumeSession: self.command,  # the engine checks the tenant
            wire.ToolDoneSoon: self.command,  # a hint about a session: the engine's
            wire.GetStats: self.command,
            wire.FlushCache: self.flush_cache,
        }

    def _prepare(self, client: ClientState, rid: str, inp: wire.Input | None,
                 job: Callable[[], Any], then: Callable[[Any], None],
                 on_refused: Callable[[], None] | None = None,
                 heavy: bool | None = None) -> None:
        """Run the preparation `job` in the client's order (in the pool if `heavy`, by
        default if `inp` is long); `then(result)` unless it was refused (answered, after
        `on_refused`)."""
        def done(result: Any) -> None:
            if isinstance(result, RequestError):
                if on_refused is not None:
                    on_refused()
                self.routes.error(client, rid, result.code, result.message)
            else:
                then(result)

        if heavy is None:
            heavy = _input_chars(inp) > INLINE_PREPARE_CHARS
        self._enqueue(client, job, done, heavy=heavy)

    def _check(self, inp: wire.Input) -> None:
        check_input(inp, self.model.vocab_size)
        check_input_size(inp, self.model.max_input_bytes, self.model.context_length)

    def forward(self, client: ClientState, msg: ToEngine) -> None:
        """Send to the engine in the client's order."""
        self._enqueue(client, None, lambda _r: self.routes.to_engine(client, msg))

    # ----------------------------------------------------------------- handlers
    def generate(self, client: ClientState, msg: wire.Generate) -> None:
        arrived = time.monotonic()  # the engine's timings start here (engine/timings.py)
        if msg.rid in client.inflight:
            raise RequestError(wire.ErrorCode.DUPLICATE_ID, f"request {msg.rid!r} is already in flight")
        if self._max_inflight and len(client.inflight) >= self._max_inflight:
            raise RequestError(wire.ErrorCode.CAPACITY,
                               f"this client has {len(client.inflight)} requests in flight, the "
                               f"server's cap (--max-inflight-per-client); wait for one to end")
        check_generate(msg, self.model.vocab_size)
        check_input_size(msg.input, self.model.max_input_bytes, self.model.context_length)
        check_tools(msg.tools, self.model.context_length)
        plan = plan_structured(msg, self.model.tool_format)
        key = next(self._keys)
        stream = RequestStream(key, client.identity, msg.rid, stream=msg.stream, n=msg.n,
                               sampling=msg.sampling, session=msg.session,
                               tokenizer=self.model.tokenizer,
                               calls=plan.reader if plan.parse_calls else None,
                               logprob_texts=msg.logprob_texts)
        self.routes.streams[key] = stream
        client.inflight[msg.rid] = key

        def then(prepared: tuple[list[int], AppendVariants | None]) -> None:
            ids, variants = prepared
            stream.prepared(ids)
            self.routes.to_engine(client, EngineGenerate(
                key=key, client=client.identity, rid=msg.rid, input_ids=ids,
                sampling=msg.sampling, prompt_logprobs_start=msg.prompt_logprobs_start,
                priority=(msg.priority if self._max_priority is None
                          else min(msg.priority, self._max_priority)),
                session=msg.session, n=msg.n,
                namespace=(client.names.namespace(msg.namespace) if msg.session is None
                           else client.names.turn_namespace(msg.namespace)),
                grammar=plan.grammar,
                assistant_open=assistant_flag(msg.input) if msg.session is not None else None,
                variants=variants, arrived=arrived,
                tools=[t.name for t in plan.tools] if plan.parse_calls and plan.tools else None,
                program=msg.program,
            ))

        model = self.model
        self._prepare(client, msg.rid, msg.input, lambda: generate_ids(model, msg), then,
                      on_refused=lambda: self.routes.end_request(stream))

    def abort(self, client: ClientState, msg: wire.Abort) -> None:
        key = client.inflight.get(msg.rid)
        if key is None:
            raise RequestError(wire.ErrorCode.NOT_FOUND, f"no request {msg.rid!r} in flight")
        self.forward(client, EngineAbort(key=key))

    def tokenize(self, client: ClientState, msg: wire.Tokenize) -> None:
        self._check(msg.input)
        check_tools(msg.tools, self.model.context_length)
        model = self.model
        def then(ids: list[int]) -> None:
            strs = None
            if msg.token_strs:
                piece = model.tokenizer.id_to_token
                strs = [piece(t) or "" for t in ids]
            self.routes.reply(client, wire.Tokens(rid=msg.rid, input_ids=ids, token_strs=strs))

        self._prepare(client, msg.rid, msg.input, lambda: input_ids(model, msg.input, True, msg.tools),
                      then)

    def detokenize(self, client: ClientState, msg: wire.Detokenize) -> None:
        check_input(wire.Input(input_ids=msg.token_ids), self.model.vocab_size)
        tokenizer = self.model.tokenizer
        self._prepare(client, msg.rid, None, lambda: tokenizer.decode(msg.token_ids),
                      lambda text: self.routes.reply(client, wire.Detokenized(rid=msg.rid, text=text)),
                      heavy=len(msg.token_ids) > INLINE_PREPARE_CHARS)

    def open_session(self, client: ClientState, msg: wire.OpenSession) -> None:
        if msg.input is not None:
            self._check(msg.input)

        def then(ids: list[int]) -> None:
            self.routes.to_engine(client, EngineOpenSession(
                client=client.identity, rid=msg.rid, input_ids=ids,
                pinned=client.names.pin(msg.pinned), retention=msg.retention, ttl_s=msg.ttl_s,
                namespace=client.names.namespace(msg.namespace),
                assistant_open=bool(assistant_flag(msg.input)),
                durable=msg.durable, tenant=client.names.tenant, program=msg.program,
            ))

        model = self.model
        self._prepare(client, msg.rid, msg.input, lambda: open_session_ids(model, msg), then)

    def pin(self, client: ClientState, msg: wire.Pin) -> None:
        check_pin_name(msg.name)
        self._check(msg.input)
        names = client.names

        def then(ids: list[int]) -> None:
            self.routes.to_engine(client, EnginePin(
                client=client.identity, rid=msg.rid, name=names.pin(msg.name) or "",
                input_ids=ids, namespace=names.namespace(msg.namespace)))

        model = self.model
        self._prepare(client, msg.rid, msg.input, lambda: pin_ids(model, msg), then)

    def fork_session(self, client: ClientState, msg: wire.ForkSession) -> None:
        check_fork(msg.n)
        self.command(client, msg)

    def close_session(self, client: ClientState, msg: wire.CloseSession) -> None:
        check_close(msg)
        self.command(client, msg)

    def unpin(self, client: ClientState, msg: wire.Unpin) -> None:
        self.command(client, wire.Unpin(rid=msg.rid, name=client.names.pin(msg.name) or ""))

    def flush_cache(self, client: ClientState, msg: wire.FlushCache) -> None:
        # With several tenants the engine flushes only this client's tenant's namespaces.
        self.forward(client, EngineCommand(client=client.identity, msg=msg,
                                           tenant=client.names.tenant))

    def command(self, client: ClientState, msg: Any) -> None:
        # The tenant: resumes and listings of durable sessions are the tenant's, not the
        # connection's (a session outlives the connection that opened it).
        self.forward(client, EngineCommand(client=client.identity, msg=msg,
                                           tenant=client.names.tenant))
