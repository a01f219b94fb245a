"""Compiled grammars, cached per tenant and compiled off the scheduler loop.

`GrammarCompiler.get(spec, owner=..., party=...)` returns at once: the `CompiledGrammar`
when the owner's cache holds it, else a `CompilingGrammar` handle whose compilation runs
on a worker thread (xgrammar releases the GIL while it compiles, so a two-second schema
does not stall the decoding of other requests), queued fairly between parties
(compile_queue.py). The scheduler keeps the request waiting and polls
`CompilingGrammar.result()`, which gives up at the time limit.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from radixlm.runtime.grammar.compile_queue import CompileQueue, Job
from radixlm.runtime.grammar.spec import GrammarSpec

if TYPE_CHECKING:  # xgrammar (and transformers, which it imports) load on first use:
    import xgrammar as xgr  # ~3 s and ~50 MB that a start-up serving no grammar never pays
    from xgrammar import CompiledGrammar
else:
    CompiledGrammar = Any  # annotations only

__all__ = ["CompiledGrammar", "CompilingGrammar", "GrammarCompiler", "GrammarError",
           "GrammarTimeout"]

log = logging.getLogger(__name__)

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_TIMEOUT_S = 60.0  # a request's wait for its grammar, queue included
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A grammar that does not compile; the message is the compiler's, naming the field."""


class GrammarTimeout(GrammarError):
    """The grammar did not compile within the compiler's time limit."""


class CompilingGrammar:
    """A compilation in flight: `result()` is None until it is done, then the compiled
    grammar (or raises its `GrammarError`); past its deadline it raises `GrammarTimeout`
    and stops waiting. `cancel()` (or dropping the handle) says nobody waits any more: a
    compilation no handle waits for leaves the queue before it starts."""

    __slots__ = ("_future", "_deadline", "_detach", "__weakref__")

    def __init__(self, future: Future[CompiledGrammar], deadline: float = math.inf) -> None:
        self._future = future
        self._deadline = deadline
        self._detach: Callable[[], Any] | None = None

    def done(self) -> bool:
        return self._future.done() or time.monotonic() >= self._deadline

    def result(self) -> CompiledGrammar | None:
        if self._future.done():
            return self._future.result()  # raises the GrammarError, if any
        if time.monotonic() >= self._deadline:
            self.cancel()
            raise GrammarTimeout("the grammar did not compile within its time limit "
                                 "(the engine's --grammar-timeout); try a simpler one")
        return None

    def wait(self, timeout: float | None = None) -> CompiledGrammar:
        return self._future.result(timeout)

    def cancel(self) -> None:
        if self._detach is not None:
            self._detach()


def default_workers() -> int:
    """Compile threads: two at least (one party never holds them all), a quarter of the
    cores at most (the rest decode)."""
    return max(2, min(8, (os.cpu_count() or 1) // 4))


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; see the module docstring.

    Thread use: `get` and `close` are called from the scheduler thread only; compilations
    run on `workers` threads, shared fairly between parties (`CompileQueue`), each party
    running at most ``workers - 1`` at once. The cache is partitioned by owner (a tenant's
    namespace): one tenant's compilations never answer another's faster, so timing says
    nothing across tenants. It holds at most `max_entries` grammars (least recently used
    dropped first); a failed compilation is not cached.
    """

    def __init__(self, info: xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo],
                 max_entries: int = DEFAULT_CACHE_ENTRIES, threads: int = 1,
                 workers: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        # A callable is called on a worker thread at the first compilation: reading a
        # large vocabulary takes a while, and the scheduler never waits for it.
        self._info = info
        self._info_lock = threading.Lock()
        self._threads = threads
        self._local = threading.local()  # each worker's own xgrammar compiler
        workers = default_workers() if workers is None else workers
        self._queue = CompileQueue(workers, per_party=max(1, workers - 1))
        self._lock = threading.Lock()  # guards _cache against the workers' error eviction
        self._cache: OrderedDict[tuple[Hashable, GrammarSpec], Job] = OrderedDict()
        self._max = max_entries
        self.timeout_s = timeout_s
        self.compiled = 0  # compilations started (cache misses)

    def get(self, spec: GrammarSpec, *, owner: Hashable = None,
            party: Hashable = None) -> CompiledGrammar | CompilingGrammar:
        """`owner`: whose cache partition (a tenant's namespace); `party`: whose share
        of the compile threads (a tenant, or a client)."""
        key = (owner, spec)
        while True:
            with self._lock:
                job = self._cache.get(key)
                if job is not None and not job.future.cancelled():
                    self._cache.move_to_end(key)
                else:
                    job = self._queue.submit(party, functools.partial(
                        self._compile_and_forget_failures, key))
                    self._cache[key] = job
                    self.compiled += 1
                    while len(self._cache) > self._max:
                        self._cache.popitem(last=False)
            future = job.future
            if future.done() and not future.cancelled() and future.exception() is None:
                return future.result()
            pending = CompilingGrammar(future, time.monotonic() + self.timeout_s)
            pending._detach = self._queue.attach(job, pending)
            # Between the lookup and the attach, the last other waiter's handle may have
            # been collected (a finalizer runs at any allocation) and cancelled the queued
            # job: waiting on it would fail this request with CancelledError. Once
            # attached, nobody else can cancel it; if it was, ask again.
            if not future.cancelled():
                return pending

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch) and wait: for tests, benchmarks and the SDK's checks."""
        got = self.get(spec)
        return got.wait() if isinstance(got, CompilingGrammar) else got

    def queued(self) -> int:
        """Compilations waiting for a thread."""
        return self._queue.queued()

    def _compile_and_forget_failures(self, key: tuple[Hashable, GrammarSpec]) -> CompiledGrammar:
        try:
            return self._compile(key[1])
        except GrammarError:
            with self._lock:
                self._cache.pop(key, None)
            raise

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        import xgrammar as xgr

        with self._info_lock:
            if not isinstance(self._info, xgr.TokenizerInfo):
                self._info = self._info()
            return self._info

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import xgrammar as xgr  # on a worker thread: the first grammar pays the import

        compiler = getattr(self._local, "xgr", None)
        if compiler is None:
            # xgrammar's own cache would grow without bound; ours is the bounded one.
            compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=self._threads,
                                           cache_enabled=False)
            self._local.xgr = compiler
        try:
            grammar = _grammar(spec)
            return compiler.compile_grammar(grammar)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{spec.kind} does not compile: {_first_line(e)}") from None

    def close(self) -> None:
        self._queue.close()


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec as one xgrammar `Grammar`: framed by its literal `begin` and `end`,
    repeated after `separator`, or'd with its `alternative`."""
    import xgrammar as xgr

    grammar = _framed(spec)
    if spec.separator is not None:
        grammar = _repeated(grammar, spec.separator)
    if spec.alternative is not None:
        grammar = xgr.Grammar.union(grammar, _grammar(spec.alternative))
    return grammar


def _repeated(grammar: xgr.Grammar, separator: str) -> xgr.Grammar:
    """``grammar (separator grammar)*``: its own rules, under a new root rule."""
    import xgrammar as xgr

    text = str(grammar)
    name = "radixlm_repeat"
    while name in text:
        name += "_"
    return xgr.Grammar.from_ebnf(f"{text}\n{name} ::= root ({json.dumps(separator)} root)*",
                                 root_rule_name=name)


def _framed(spec: GrammarSpec) -> xgr.Grammar:
    import xgrammar as xgr

    if spec.kind == "regex":
        body = xgr.Grammar.from_regex(spec.text)
    elif spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(
                f"json_schema must be a JSON object (a schema), got {type(schema).__name__}"
            )
        # Compact separators: the fewest tokens, and keys the jump-forward can force.
        body = _strict_strings(xgr.Grammar.from_json_schema(
            spec.text, any_whitespace=False, separators=(", ", ": "), strict_mode=True
        ))
    elif spec.kind == "ebnf":
        body = xgr.Grammar.from_ebnf(spec.text, root_rule_name="root")
    else:
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")
    if not spec.begin and not spec.end:
        return body
    parts = [_literal(spec.begin)] if spec.begin else []
    parts.append(body)
    if spec.end:
        parts.append(_literal(spec.end))
    return xgr.Grammar.concat(*parts)


# xgrammar (0.2.9) writes length-limited JSON strings (minLength/maxLength) with a
# character class that admits raw control characters, which JSON forbids; rewrite that
# class to the one its unlimited strings use.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _strict_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    import xgrammar as xgr

    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _literal(text: str) -> xgr.Grammar:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _first_line(e: BaseException) -> str:
    """The compiler's message without xgrammar's "[time] file.cc:line: " prefix."""
    text = _XGR_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0] if text else type(e).__name__
