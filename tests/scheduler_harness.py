"""Shared fixtures for the scheduler tests: drive a `Scheduler` in-process (no ZeroMQ)
over a tiny random checkpoint, and an independent reference (HF transformers).

Import it from a test module with ``from scheduler_harness import ...`` (tests/ is on
pytest's pythonpath); pytest finds no tests here.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool, PrefixCache
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.engine.scheduler import Scheduler
from radixlm.runtime.engine.sessions import SessionManager
from radixlm.runtime.engine.wire import EngineGenerate, StepOutputs, ToClient, TokenOutput
from radixlm.runtime.model import ModelConfig, ModelRunner
from radixlm.runtime.protocol import SamplingParams, decode_server
from radixlm.tokenizer import Tokenizer
from tiny_models import EOS_ID, load_hf_model

CONTEXT = 256  # the tiny checkpoints' max_position_embeddings


class Harness:
    """One scheduler over its own pool; collects what it would send to the frontend."""

    def __init__(
        self,
        model_dir: Path,
        *,
        capacity: int = 2048,
        page_size: int = 1,
        eos: Sequence[int] = (EOS_ID,),
        sessions: bool = False,
        engine_config: EngineConfig | None = None,
        model=None,
        grammars=None,
        clock=None,
        state_dir: Path | None = None,
        **options,
    ) -> None:
        cfg = ModelConfig.from_dir(model_dir)
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, page_size,
                           torch.float32, "cpu")
        self.runner = model or ModelRunner(model_dir, "cpu", torch.float32, self.pool, "torch")
        self.cache = PrefixCache(capacity, page_size, policy="priority")
        manager = None
        self.durable = None
        if sessions:
            if state_dir is not None:  # durable sessions' rows (no loop: written inline)
                from radixlm.runtime.engine.sessions.durable import DurableLog

                self.durable = DurableLog(state_dir / "engine.sqlite")
            manager = SessionManager(self.cache, engine_config or EngineConfig(), kv_pool=self.pool,
                                     durable=self.durable)
        options.setdefault("context_length", CONTEXT)
        options.setdefault("check_invariants", True)
        self.tokenizer = Tokenizer.load(model_dir)
        self.sched = Scheduler(self.cache, self.runner, Sampler(cfg.vocab_size),
                               SchedulerOptions(**options), eos_token_ids=eos, sessions=manager,
                               grammars=grammars, tokenizer=self.tokenizer,
                               **({} if clock is None else {"clock": clock}))
        self.tokens: dict[tuple[int, int], list[int]] = defaultdict(list)
        self.final: dict[tuple[int, int], TokenOutput] = {}
        self.logprobs: dict[tuple[int, int], list[float]] = defaultdict(list)
        self.replies: list = []
        self.steps = 0
        self._keys = itertools.count(1)

    # ------------------------------------------------------------------ input
    def generate(self, prompt: Sequence[int], *, max_tokens: int = 8, temperature: float = 0.0,
                 ignore_eos: bool = True, client: bytes = b"c", key: int | None = None,
                 sampling: SamplingParams | None = None, **fields) -> int:
        key = next(self._keys) if key is None else key
        sampling = sampling or SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                              ignore_eos=ignore_eos)
        self.sched.handle(EngineGenerate(key=key, client=client, rid=f"r{key}",
                                         input_ids=[int(t) for t in prompt], sampling=sampling,
                                         **fields))
        self.collect()
        return key

    def send(self, msg) -> None:
        self.sched.handle(msg)
        self.collect()

    # ------------------------------------------------------------------- loop
    def step(self) -> bool:
        ran = self.sched.step()
        self.steps += 1
        self.collect()
        return ran

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            if not self.step():
                time.sleep(0.002)  # e.g. a grammar compiling on its thread: as the engine polls
        raise AssertionError(f"scheduler did not finish in {max_steps} steps")

    def collect(self) -> None:
        for m in self.sched.take_outbox():
            if isinstance(m, StepOutputs):
                for o in m.outputs:
                    k = (o.key, o.index)
                    assert k not in self.final, f"output after the final one for {k}"
                    self.tokens[k].extend(o.token_ids)
                    if o.logprobs is not None:
                        assert len(o.logprobs) == len(o.token_ids)
                        self.logprobs[k].extend(o.logprobs)
                    if o.finish_reason is not None:
                        self.final[k] = o
            else:
                assert isinstance(m, ToClient)
                self.replies.append(decode_server(m.data))

    # ---------------------------------------------------------------- results
    def output(self, key: int, index: int = 0) -> list[int]:
        assert (key, index) in self.final, f"request {key}/{index} has not finished"
        return self.tokens[(key, index)]

    def check_quiescent(self) -> None:
        """Nothing running: free + evictable + protected == capacity, tree consistent."""
        self.collect()
        s = self.sched
        assert not s.running, f"requests still running: {s.running}"
        s.check_integrity()
        sizes = self.cache.sizes()
        assert sizes.free + sizes.evictable + sizes.protected == sizes.capacity, sizes


def hf_greedy(hf, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy continuation by transformers (EOS not special: like ignore_eos)."""
    out_ids: list[int] = []
    with torch.no_grad():
        out = hf(torch.tensor([list(prompt)]), use_cache=True)
        for i in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            if i + 1 < n:
                out = hf(torch.tensor([[tok]]), cache=out.past_key_values,
                         use_cache=True)
    return out_ids


def hf_prompt_logprobs(hf, prompt: Sequence[int], start: int) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) for i in [max(start, 1), len(prompt))."""
    with torch.no_grad():
        logits = hf(torch.tensor([list(prompt)])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    first = max(start, 1)
    idx = torch.arange(first, len(prompt))
    return lp[idx - 1, torch.tensor(prompt)[idx]].numpy()


def output_text(tok: Tokenizer, context: Sequence[int], ids: Sequence[int]) -> str:
    """The text `ids` add after `context` (its last 5 tokens, as the detokenizers take it),
    by `tokenizers`' own decode of the whole sequence."""
    tail = [int(t) for t in context][-5:]
    before = tok.backend.decode(tail, skip_special_tokens=True)
    return tok.backend.decode(tail + [int(t) for t in ids], skip_special_tokens=True)[len(before):]


def stop_inside(tok: Tokenizer, context: Sequence[int], ids: Sequence[int], token: int,
                length: int = 3) -> tuple[str, int, str]:
    """A stop string that starts inside the text of output token `token` (or the first
    later one with clean text), the tokens a branch ending at it keeps (the shortest prefix
    whose text covers what precedes it) and that text: (stop, kept, text)."""
    full = output_text(tok, context, ids)
    for k in range(token, len(ids)):
        start = len(output_text(tok, context, ids[:k]))
        end = len(output_text(tok, context, ids[: k + 1]))
        if end <= start or "\ufffd" in full[max(0, start - 1) : end + length]:
            continue
        at = start + (end - start) // 2 if end - start > 1 else start
        stop = full[at : at + length]
        if len(stop) < length or full.find(stop) != at:
            continue
        before = full[:at]
        kept = next(n for n in range(len(ids) + 1)
                    if output_text(tok, context, ids[:n]).startswith(before))
        return stop, kept, before
    raise AssertionError("no clean stop string in this output: pick another prompt")


def random_prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 440, n).tolist()


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> Path:
    """conftest's session-wide tiny Llama checkpoint (context 256, EOS id 2)."""
    return Path(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return load_hf_model(tiny_dir)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest single-threaded (and the CI box has 2 contended cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_harness(tiny_dir):
    made: list[Harness] = []

    def factory(**kwargs) -> Harness:
        h = Harness(tiny_dir, **kwargs)
        made.append(h)
        return h

    yield factory
    for h in made:
        h.check_quiescent()


@pytest.fixture(autouse=True)
def scheduler_pool_integrity(make_harness):
    """Every test's schedulers end idle with free + evictable + protected == capacity
    (checked in make_harness's teardown; with check_invariants, after every step too)."""
    yield
