"""Inbound messages: each one from the frontend becomes queued requests, an ending, or a
direct reply. Refusals are `Error` replies; a failure while handling a message answers
that message's client with INTERNAL and leaves the engine serving."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.outbox import Outbox
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.engine.sampling import make_generator
from radixlm.runtime.engine.sessions.controller import (
    Intake,
    SessionController,
    Turn,
    client_program,
)
from radixlm.runtime.engine.state import TERMINAL, ReqState
from radixlm.runtime.engine.table import RequestTable
from radixlm.runtime.engine.wire import (
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
    TokenOutput,
)
from radixlm.runtime.grammar.compiler import CompiledGrammar, CompilingGrammar
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.protocol import Error, ErrorCode, SamplingParams, Struct, branch_seed
from radixlm.runtime.rules import (
    RequestError,
    check_prompt,
    check_prompt_logprobs_start,
    resolve_max_tokens,
)
from radixlm.tokenizer import Tokenizer, TokenStopMatcher
from radixlm.tokenizer.call_parser import CallParser
from radixlm.tokenizer.tools import framed_format

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class MessageHandler:
    """Inbound messages to requests, endings and replies (see the module doc)."""

    table: RequestTable
    endings: Endings
    sessions: SessionController
    outbox: Outbox
    opt: SchedulerOptions
    capacity: int  # KV pool tokens
    page_size: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device: torch.device  # where seeded requests' generators live
    engine_command: Callable[[EngineCommand], Struct]  # stats, flush: the scheduler's
    grammars: Grammars | None = None  # None: constrained requests are refused
    tokenizer: Tokenizer | None = None  # None: stop strings are refused
    _arrival: Iterator[int] = field(default_factory=itertools.count)
    _internal_keys: Iterator[int] = field(default_factory=lambda: itertools.count(-1, -1))

    def handle(self, msg: object) -> None:
        try:
            self._dispatch(msg)
        except Exception as exc:  # noqa: BLE001
            log.exception("scheduler: handling %s failed", type(msg).__name__)
            error = RequestError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            key = getattr(msg, "key", None)
            if key is not None and key in self.table.groups:
                self.endings.fail_group(self.table.groups[key], error)
            elif isinstance(msg, (EngineGenerate, EngineOpenSession, EnginePin, EngineCommand)):
                rid = msg.msg.rid if isinstance(msg, EngineCommand) else msg.rid
                ends = msg.key if isinstance(msg, EngineGenerate) else None
                self.outbox.reply(msg.client, Error(rid=rid, code=error.code,
                                                    message=error.message), ends)
                if ends is not None:
                    self._refused_output(ends)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, EngineGenerate):
            self._on_generate(msg)
        elif isinstance(msg, EngineAbort):
            self.endings.abort(msg.key)
        elif isinstance(msg, EngineOpenSession):
            self._on_open_session(msg)
        elif isinstance(msg, EnginePin):
            self._on_pin(msg)
        elif isinstance(msg, EngineCommand):
            reply = self.sessions.command(msg)
            self.outbox.reply(msg.client, reply if reply is not None else self.engine_command(msg))
        elif isinstance(msg, ClientGone):
            self._on_client_gone(msg.client)
        else:
            log.warning("scheduler: ignoring unexpected message %r", type(msg).__name__)

    def _refused_output(self, key: int) -> None:
        """Tell the frontend a Generate ended (its client got an Error)."""
        self.outbox.outputs.append(TokenOutput(key=key, token_ids=[], finish_reason="error"))

    # --------------------------------------------------------------- requests
    def _on_generate(self, msg: EngineGenerate) -> None:
        if msg.key in self.table.groups:
            self.outbox.reply(msg.client, Error(
                rid=msg.rid, code=ErrorCode.DUPLICATE_ID,
                message=f"engine key {msg.key} is already in flight"))  # fmt: skip
            return
        intake: Intake | None = None
        try:
            appended = np.asarray(msg.input_ids, dtype=np.int64)
            if msg.session is not None:
                intake = self.sessions.begin_generate(msg, appended)
            if intake is not None:
                prompt, appended = intake.prompt, intake.appended
            else:
                prompt = appended
            history = len(prompt) - len(appended)
            start = msg.prompt_logprobs_start
            check_prompt_logprobs_start(start, len(appended), history)
            sampling = resolve_max_tokens(msg.sampling, len(prompt),
                                          context_length=self.opt.context_length,
                                          pool=self.capacity)
            self._check_fits(len(prompt), sampling.max_tokens, history)
            grammar = self._grammar(
                msg.grammar, intake.namespace if intake is not None else msg.namespace,
                msg.client)
            if (msg.sampling.stop or msg.sampling.stop_regex) and self.tokenizer is None:
                raise RequestError(ErrorCode.INVALID_PARAMS, "this engine has no tokenizer: "
                                   "it cannot match stop strings or stop_regex")
        except RequestError as e:
            if intake is not None:
                self.sessions.abort_intake(intake, msg.client)
            self.outbox.reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message),
                              msg.key)
            self._refused_output(msg.key)
            return
        self._enqueue(RequestGroup(
            key=msg.key, kind=RequestKind.GENERATE, client=msg.client, rid=msg.rid,
            prompt=prompt, sampling=sampling, n=msg.n,
            namespace=intake.namespace if intake is not None else msg.namespace,
            turn=intake.turn if intake is not None else None,
            prompt_logprobs_start=None if start is None else history + start,
            priority=msg.priority, grammar=grammar,
            times=self.endings.counters.latency.start(msg.arrived),
            tools=tuple(msg.tools) if msg.tools else None,
            program=(intake.program if intake is not None
                     else client_program(msg.client, msg.program)),
        ), stop_context=msg.input_ids, calls=msg.grammar)  # fmt: skip

    def _grammar(self, spec: GrammarSpec | None, namespace: str | None,
                 client: bytes) -> CompiledGrammar | CompilingGrammar | None:
        """The compiled grammar, or its compilation in flight (the group then waits in
        `table.compiling`; a grammar that does not compile fails it there). The cache is
        the namespace's own (its tenant's: nothing of one is answered faster for another);
        compile threads are shared fairly between tenants, or clients without one."""
        if spec is None:
            return None
        if self.grammars is None:
            raise RequestError(ErrorCode.INVALID_PARAMS,
                               "this engine has no tokenizer: it cannot serve grammars")
        party = namespace.partition("/")[0] if namespace is not None else client
        return self.grammars.get(spec, owner=namespace, party=party)

    def _on_open_session(self, msg: EngineOpenSession) -> None:
        try:
            intake = self.sessions.begin_open(msg)
            if intake is None:
                return  # no input: answered already
            try:
                self._check_fits(len(intake.prompt), 0, len(intake.prompt) - len(msg.input_ids))
            except RequestError:
                self.sessions.abort_intake(intake, msg.client, opened=True)
                raise
        except RequestError as e:
            self.outbox.reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message))
            return
        g = self._prefill_only(RequestKind.OPEN_SESSION, msg.client, msg.rid, intake.prompt,
                               intake.namespace, intake.turn)
        g.program = intake.program
        self._enqueue(g)

    def _on_pin(self, msg: EnginePin) -> None:
        prompt = np.asarray(msg.input_ids, dtype=np.int64)
        try:
            self._check_fits(len(prompt), 0, 0, what=f"the input of pin {msg.name!r}")
            turn = self.sessions.begin_pin(msg, prompt)
        except RequestError as e:
            self.outbox.reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message))
            return
        self._enqueue(self._prefill_only(RequestKind.PIN, msg.client, msg.rid, prompt,
                                         msg.namespace, turn))

    def _prefill_only(self, kind: RequestKind, client: bytes, rid: str, prompt: np.ndarray,
                      namespace: str | None, turn: Turn) -> RequestGroup:
        return RequestGroup(
            key=next(self._internal_keys), kind=kind, client=client, rid=rid,
            prompt=np.asarray(prompt, dtype=np.int64), sampling=SamplingParams(max_tokens=0),
            namespace=namespace, turn=turn,
        )  # fmt: skip

    def _check_fits(self, prompt_len: int, max_tokens: int, history_len: int,
                    what: str = "the prompt") -> None:
        """The prompt rules (rules.check_prompt) against this engine's context and pool
        and what pins and hard sessions retain."""
        check_prompt(prompt_len, max_tokens, context_length=self.opt.context_length,
                     pool=self.capacity, retained=self.sessions.unreclaimable_tokens(),
                     history_len=history_len, what=what)

    def _enqueue(self, g: RequestGroup, stop_context: list[int] | None = None,
                 calls: GrammarSpec | None = None) -> None:
        """Queue the group's branches (`stop_context`: the input's ids, the left context
        of a stop-string matcher's text, as of the frontend's detokenizer; `calls`: the
        grammar, whose parallel tool calls end at the first repeat)."""
        parallel = calls.separator if calls is not None and self.tokenizer is not None else None
        g.stop_ids = frozenset(g.sampling.stop_token_ids) | (
            frozenset() if g.sampling.ignore_eos else self.eos_token_ids
        )
        g.token_limit = min(g.prompt_len + g.max_tokens, self.opt.context_length)
        seed = g.sampling.seed
        if seed is not None:  # a forked session's turn: its lineage's offset
            seed = branch_seed(seed, self.sessions.seed_offset(g))
        for i in range(g.n):
            r = Request.new(g, i, next(self._arrival), self.page_size)
            if seed is not None:
                r.generator = make_generator(branch_seed(seed, i), self.device)
            if i > 0:
                r.after = g.branches[0]
            if g.sampling.logprobs or g.sampling.top_logprobs:
                r.logprobs = []
                r.top_logprobs = [] if g.sampling.top_logprobs else None
            if (g.sampling.stop or g.sampling.stop_regex or parallel is not None) \
                    and stop_context is not None:
                watch = None
                if calls is not None and parallel is not None:  # the grammar checked names
                    watch = CallParser(framed_format(calls.begin, calls.end), None)
                r.stops = TokenStopMatcher(self.tokenizer, g.sampling.stop, stop_context,
                                           g.sampling.stop_regex, watch)
            g.branches.append(r)
        self.table.add(g, held=self.sessions.loading(g))

    # ---------------------------------------------------------------- endings
    def _on_client_gone(self, client: bytes) -> None:
        self.sessions.forget_held(client)  # its messages held behind a tail: dropped
        for g in [g for g in self.table.groups.values() if g.client == client]:
            for r in g.branches:
                if r.state in TERMINAL:
                    continue
                if r.reported:  # its Done went out: the turn stands (a durable session
                    self.endings.end_pending(r)  # keeps it; others are closed below)
                else:
                    self.endings.end(r, ReqState.ABORTED, "abort")
        self.sessions.client_gone(client)
