"""Compiled grammars, cached by spec and compiled off the scheduler loop.

`GrammarCompiler.get(spec)` returns at once: the `CompiledGrammar` when it is cached,
else a `Pending` handle whose compilation runs on a worker thread (xgrammar releases the
GIL while it compiles, so a two-second schema does not stall the decoding of other
requests). The scheduler keeps the request waiting and polls `Pending.result()`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr
from radixlm.runtime.grammar.spec import GrammarSpec

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "Pending"]

log = logging.getLogger(__name__)

CompiledGrammar = xgr.CompiledGrammar
DEFAULT_CACHE_ENTRIES = 256
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A grammar that does not compile; the message is the compiler's, naming the field."""


class Pending:
    """A compilation in flight: `result()` is None until it is done, then the compiled
    grammar (or raises its `GrammarError`)."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[CompiledGrammar]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> CompiledGrammar | None:
        if not self._future.done():
            return None
        return self._future.result()  # raises the GrammarError, if any

    def wait(self, timeout: float | None = None) -> CompiledGrammar:
        return self._future.result(timeout)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer; see the module docstring.

    Thread use: `get` and `close` are called from the scheduler thread only; compilations
    run on one worker thread (more would contend with the model for the CPU). The cache
    holds at most `max_entries` specs (least recently used dropped first); a failed
    compilation is not cached.
    """

    def __init__(self, info: xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo],
                 max_entries: int = DEFAULT_CACHE_ENTRIES, threads: int = 1) -> None:
        # A callable is called on the worker thread at the first compilation: reading a
        # large vocabulary takes a while, and the scheduler never waits for it.
        self._info = info
        self._threads = threads
        self._xgr: xgr.GrammarCompiler | None = None  # touched by the worker thread only
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # guards _cache against the worker's error eviction
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()
        self._max = max_entries
        self.compiled = 0  # compilations started (cache misses)

    def get(self, spec: GrammarSpec) -> CompiledGrammar | Pending:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
            else:
                future = self._pool.submit(self._compile_and_forget_failures, spec)
                self._cache[spec] = future
                self.compiled += 1
                while len(self._cache) > self._max:
                    self._cache.popitem(last=False)
        if future.done() and future.exception() is None:
            return future.result()
        return Pending(future)

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch) and wait: for tests, benchmarks and the SDK's checks."""
        got = self.get(spec)
        return got.wait() if isinstance(got, Pending) else got

    def _compile_and_forget_failures(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return self._compile(spec)
        except GrammarError:
            with self._lock:
                self._cache.pop(spec, None)
            raise

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if self._xgr is None:
            info = self._info if isinstance(self._info, xgr.TokenizerInfo) else self._info()
            # xgrammar's own cache would grow without bound; ours is the bounded one.
            self._xgr = xgr.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
        try:
            grammar = _grammar(spec)
            return self._xgr.compile_grammar(grammar)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{spec.kind} does not compile: {_first_line(e)}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec as one xgrammar `Grammar`: framed by its literal `begin` and `end`,
    repeated after `separator`, or'd with its `alternative`."""
    grammar = _framed(spec)
    if spec.separator is not None:
        grammar = _repeated(grammar, spec.separator)
    if spec.alternative is not None:
        grammar = xgr.Grammar.union(grammar, _grammar(spec.alternative))
    return grammar


def _repeated(grammar: xgr.Grammar, separator: str) -> xgr.Grammar:
    """``grammar (separator grammar)*``: its own rules, under a new root rule."""
    text = str(grammar)
    name = "radixlm_repeat"
    while name in text:
        name += "_"
    return xgr.Grammar.from_ebnf(f"{text}\n{name} ::= root ({json.dumps(separator)} root)*",
                                 root_rule_name=name)


def _framed(spec: GrammarSpec) -> xgr.Grammar:
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
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _first_line(e: BaseException) -> str:
    """The compiler's message without xgrammar's "[time] file.cc:line: " prefix."""
    text = _XGR_PREFIX.sub("", str(e).strip())
    return text.splitlines()[0] if text else type(e).__name__
