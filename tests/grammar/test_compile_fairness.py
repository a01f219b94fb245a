"""Grammar compilation shared between tenants (issue 24): each tenant's cache is its own
(another tenant's schema is never answered from it, so timing says nothing across
tenants); compile threads are shared round-robin between parties, none holding them all;
a request waits at most its time limit; a compilation nobody waits for leaves the queue.

Slow compilations are simulated by gates (a compile that takes as long as the test
wants); the compiled grammars are checked against the language they must accept."""

from __future__ import annotations

import gc
import re
import threading
import time

import pytest
from radixlm.runtime.engine.wire import EngineAbort
from radixlm.runtime.grammar.compiler import CompilingGrammar, GrammarCompiler, GrammarTimeout
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.runtime.model import ModelConfig
from radixlm.runtime.protocol import SamplingParams
from radixlm.tokenizer import Tokenizer
from scheduler_harness import make_harness, tiny_dir  # noqa: F401 - the fixtures
from tiny_models import EOS_ID

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:  # noqa: ANN001, F811 - the harness's tiny model
    return Tokenizer.load(tiny_dir)


def regex(text: str) -> GrammarSpec:
    return GrammarSpec(kind="regex", text=text)


class Recording(GrammarCompiler):
    """Records the order compilations start in; those whose regex starts with "slow"
    wait for `gate`."""

    def __init__(self, tok: Tokenizer, gate: threading.Event, vocab: int | None = None,
                 **kw: object) -> None:
        super().__init__(tokenizer_info(tok, vocab or tok.vocab_size, {EOS_ID}), **kw)
        self.gate = gate
        self.started: list[str] = []
        self._order = threading.Lock()

    def _compile(self, spec: GrammarSpec):  # noqa: ANN202
        with self._order:
            self.started.append(spec.text)
        if spec.text.startswith("slow"):
            assert self.gate.wait(60)
        return super()._compile(spec)


def _accepts(compiled: object, tok: Tokenizer, text: str) -> bool:
    state = GrammarState(compiled, {EOS_ID})
    return all(state.accept(t) for t in tok.encode(text)) and state.accept(EOS_ID)


def _wait(pending: CompilingGrammar, timeout_s: float = 30.0):  # noqa: ANN202
    deadline = time.monotonic() + timeout_s
    while (got := pending.result()) is None:
        assert time.monotonic() < deadline, "the compilation did not finish"
        time.sleep(0.005)
    return got


def _holding(c: Recording) -> CompilingGrammar:
    """A gated compilation that has taken the (one) compile thread."""
    hold = c.get(regex("slow-hold"), owner="z", party="z")
    while "slow-hold" not in c.started:
        time.sleep(0.005)
    assert isinstance(hold, CompilingGrammar)
    return hold


def test_each_tenant_has_its_own_cache(tok: Tokenizer) -> None:
    c = Recording(tok, threading.Event(), workers=2)
    try:
        spec = regex("[0-9]{4}-[0-9]{2}")
        first = c.get(spec, owner="alice", party="alice")
        compiled = _wait(first) if isinstance(first, CompilingGrammar) else first
        assert _accepts(compiled, tok, "2024-01") and not _accepts(compiled, tok, "2024")
        assert c.get(spec, owner="alice", party="alice") is compiled  # her own cache
        other = c.get(spec, owner="bob", party="bob")
        assert isinstance(other, CompilingGrammar), "bob was answered from alice's compilation"
        assert _accepts(_wait(other), tok, "1999-12")
        assert c.compiled == 2 and c.started == [spec.text, spec.text]
        assert c.get(spec, owner="bob/ns", party="bob") is not compiled
    finally:
        c.close()


def test_one_partys_slow_grammars_never_hold_every_thread(tok: Tokenizer) -> None:
    gate = threading.Event()
    c = Recording(tok, gate, workers=2)
    try:
        slow = [c.get(regex(f"slow{i}[a-z]+"), owner="a", party="a") for i in range(6)]
        tiny = c.get(regex("ok"), owner="b", party="b")
        assert isinstance(tiny, CompilingGrammar)
        assert _accepts(_wait(tiny, 20), tok, "ok")  # while all six are held at the gate
        assert sum(s.startswith("slow") for s in c.started) == 1  # one thread for party a
        assert all(p.result() is None for p in slow)
        gate.set()
        for i, p in enumerate(slow):
            assert _accepts(_wait(p), tok, f"slow{i}xyz")
    finally:
        gate.set()
        c.close()


def test_parties_take_turns(tok: Tokenizer) -> None:
    gate = threading.Event()
    c = Recording(tok, gate, workers=1)
    try:
        hold = _holding(c)  # the one thread waits
        a = [c.get(regex(f"a{i}"), owner="a", party="a") for i in range(3)]
        b = [c.get(regex(f"b{i}"), owner="b", party="b") for i in range(3)]
        gate.set()
        for p in [hold, *a, *b]:
            _wait(p)
        assert c.started[1:] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    finally:
        gate.set()
        c.close()


def test_a_compilation_nobody_waits_for_leaves_the_queue(tok: Tokenizer) -> None:
    gate = threading.Event()
    c = Recording(tok, gate, workers=1)
    try:
        hold = _holding(c)
        dropped = c.get(regex("dropped"), owner="a", party="a")
        cancelled = c.get(regex("cancelled"), owner="a", party="a")
        kept = c.get(regex("kept"), owner="a", party="a")
        assert c.queued() == 3
        del dropped  # its request was aborted: nothing holds the handle any more
        gc.collect()
        assert isinstance(cancelled, CompilingGrammar)
        cancelled.cancel()
        assert c.queued() == 1
        gate.set()
        _wait(hold)
        _wait(kept)
        assert c.started == ["slow-hold", "kept"]
        again = c.get(regex("dropped"), owner="a", party="a")  # asked again: compiled anew
        assert _accepts(_wait(again), tok, "dropped")
    finally:
        gate.set()
        c.close()


def test_a_grammar_that_takes_too_long_fails_at_its_time_limit(tok: Tokenizer) -> None:
    gate = threading.Event()
    c = Recording(tok, gate, workers=2, timeout_s=0.3)
    try:
        pending = c.get(regex("slow-forever"), owner="a", party="a")
        assert isinstance(pending, CompilingGrammar) and not pending.done()
        time.sleep(0.4)
        assert pending.done()
        with pytest.raises(GrammarTimeout, match="time limit"):
            pending.result()
    finally:
        gate.set()
        c.close()


def test_an_aborted_request_cancels_its_queued_compilation(make_harness, tok, tiny_dir) -> None:  # noqa: ANN001, F811, E501
    gate = threading.Event()
    vocab = ModelConfig.from_dir(tiny_dir).vocab_size
    compiler = Recording(tok, gate, workers=1, vocab=vocab)
    grammars = Grammars(tok, vocab, [EOS_ID], compiler=compiler)
    try:
        h = make_harness(grammars=grammars)
        sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=1)
        first = h.generate(tok.encode("x"), sampling=sampling, grammar=regex("slow[a-z]"),
                           client=b"one")
        while compiler.started != ["slow[a-z]"]:
            time.sleep(0.005)
        queued = h.generate(tok.encode("x"), sampling=sampling, grammar=regex("q[a-z]"),
                            client=b"two")
        h.step()
        assert compiler.queued() == 1
        h.send(EngineAbort(key=queued))
        h.step()
        gc.collect()
        assert h.final[(queued, 0)].finish_reason == "abort"
        assert compiler.queued() == 0  # nobody waits for it: it never runs
        gate.set()
        h.run()
        out = h.output(first)
        assert out[-1] == EOS_ID and re.fullmatch("slow[a-z]", tok.decode(out[:-1]))
        assert compiler.started == ["slow[a-z]"]
    finally:
        gate.set()
        grammars.close()


def test_a_waiter_collected_while_another_attaches_does_not_cancel_its_compile(
        tok: Tokenizer) -> None:
    """The race behind a fuzz run's one INTERNAL reply: request B finds A's queued job in
    the cache; before B attaches, A's dropped handle is collected (a finalizer runs at any
    allocation) and, as the job's last waiter, cancels it. B must get the grammar, not a
    CancelledError."""
    gate = threading.Event()
    c = Recording(tok, gate, workers=1)
    try:
        hold = _holding(c)
        first = c.get(regex("shared"), owner="a", party="a")
        assert isinstance(first, CompilingGrammar) and c.queued() == 1
        queue = c._queue
        real_attach = queue.attach
        dropped = [first]
        del first

        def attach_after_a_collection(job, handle):  # noqa: ANN001, ANN202
            dropped.clear()  # A's request aborted: its handle goes, here, mid-get
            gc.collect()
            return real_attach(job, handle)

        queue.attach = attach_after_a_collection  # type: ignore[method-assign]
        second = c.get(regex("shared"), owner="a", party="a")
        queue.attach = real_attach  # type: ignore[method-assign]
        assert isinstance(second, CompilingGrammar)
        gate.set()
        _wait(hold)
        assert _accepts(_wait(second), tok, "shared")  # on the old code: CancelledError
    finally:
        gate.set()
        c.close()
