"""The engine process: model, KV pool, prefix cache, sessions and the scheduler loop.

`run_engine(config, endpoints)` binds the PULL socket it reads (`endpoints.to_engine`),
connects the PUSH socket it writes (`endpoints.to_frontend`), sends `EngineReady`, then
serves (serve_loop.py): take every queued message, run one scheduler step if there is
work, send what the step produced, and wait for a message only when idle; an intake
thread reads the socket and answers control requests while a forward runs. It never
waits on a client or on tokenization. `Shutdown` or SIGTERM stops it at the next
iteration.
"""

from __future__ import annotations

import gc
import logging
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import zmq
from radixlm.cache import KVPool, PrefixCache
from radixlm.runtime.config import Endpoints, EngineConfig, context_length_for
from radixlm.runtime.engine.durable_state import EngineState, open_disk_tier, open_engine_state
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.pool_size import kv_capacity
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.engine.scheduler import Scheduler
from radixlm.runtime.engine.serve_loop import EngineLoop, StopFlag
from radixlm.runtime.engine.sessions import SessionManager
from radixlm.runtime.engine.wire import EnginePin, EngineReady, encode
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.memory import keep_freed_blocks, release_free_memory
from radixlm.runtime.model import (
    ModelConfig,
    ModelRunner,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from radixlm.runtime.model import resolve_model as _resolve_model
from radixlm.runtime.model.loader import engine_weight_format
from radixlm.runtime.model.memory_check import check_model_fits
from radixlm.runtime.transport.channel import open_socket
from radixlm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from radixlm.runtime.distributed import TensorParallel, TensorParallelRunner

log = logging.getLogger("radixlm.engine")

STATS_EVERY_S = 10.0


@dataclass
class Engine:
    """Everything `build_engine` made; `ready` is what the frontend is told."""

    scheduler: Scheduler
    runner: ModelRunner | TensorParallelRunner
    ready: EngineReady
    tp: TensorParallel | None = None  # the other ranks, with --tensor-parallel-size > 1
    state: EngineState | None = None  # with a state directory

    def close(self) -> None:
        if self.tp is not None:
            self.tp.close()
        if self.state is not None:
            self.state.close()


def build_engine(config: EngineConfig, model_dir: str | Path | None = None,
                 boot: str = "") -> Engine:
    """Resolve and load the model, size the pool, and wire cache, sessions and scheduler."""
    t0 = time.perf_counter()
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    model_dir = Path(model_dir) if model_dir is not None else _resolve_model(config.model)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    fmt = engine_weight_format(config.dtype, config.quantize, model_dir, device)
    kv_dtype = resolve_kv_dtype(config.kv_dtype, device, dtype, quantized=fmt is not None)
    mcfg = ModelConfig.from_dir(model_dir)
    context = context_length_for(config, mcfg.max_position_embeddings)
    tp = None
    if config.tensor_parallel_size > 1:  # ranks 1..N-1 are processes of ours from here on
        from radixlm.runtime.distributed import start_engine_ranks

        tp = start_engine_ranks(config, model_dir, device, dtype, context)
        runner, pool = tp.runner, tp.runner.pool
        capacity = pool.capacity
    else:
        if device.type == "cpu":  # refuse, naming --kv-tokens / --kv-dtype, what will not fit
            check_model_fits(model_dir, mcfg, fmt, dtype, kv_dtype, config.kv_tokens,
                             config.chunked_prefill, context, torch.get_num_threads())
        log.info("loading %s (%s weights)", model_dir.name, fmt or str(dtype).removeprefix("torch."))
        t_load = time.perf_counter()
        model = load_model(model_dir, device, dtype, fmt)
        t_load = time.perf_counter() - t_load
        capacity = kv_capacity(
            config.kv_tokens, config.kv_memory_fraction, mcfg, device, kv_dtype, config.page_size,
            usable_tokens=context * config.max_running, weights=model.resident_bytes(),
        )  # fmt: skip
        pool = KVPool(
            mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, capacity, config.page_size, kv_dtype,
            device,
        )  # fmt: skip
        runner = ModelRunner.from_model(model, pool, config.attention)
        runner.model_dir = model_dir
        log.info("weights: %s, %.1f MiB held, %.1f MiB read per decode step, loaded in %.2fs",
                 model.weight_format, model.resident_bytes() / 2**20, model.weight_bytes() / 2**20,
                 t_load)  # fmt: skip
    # "priority": demoted session histories are evicted after plain cache (retention.py).
    cache = PrefixCache(capacity, config.page_size, policy="priority")
    state = open_engine_state(config.state_dir, model_dir, {
        "weights": fmt or str(dtype), "kv_dtype": str(kv_dtype), "page_size": config.page_size,
        "kv_layout": (mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim),
        "tensor_parallel": config.tensor_parallel_size,
    })  # fmt: skip
    disk = None if state is None else open_disk_tier(state, pool, config.disk_kv_bytes,
                                                     config.tensor_parallel_size)
    sessions = SessionManager(cache, config, kv_pool=pool,
                              durable=state.log if state is not None else None, disk=disk)
    restored_pins = _load_state(state, sessions)
    eos = set(mcfg.eos_token_ids)
    grammars = tokenizer = None
    try:
        t_tok = time.perf_counter()
        tokenizer = Tokenizer.load(model_dir)
        eos |= tokenizer.eos_token_ids
        # Grammars need the vocabulary's text (masks) and the tokenizer (jump-forward).
        grammars = Grammars(tokenizer, mcfg.vocab_size, eos,
                            timeout_s=config.grammar_timeout_s)
        log.info("tokenizer and grammar vocabulary loaded in %.2fs", time.perf_counter() - t_tok)
    except Exception as e:  # noqa: BLE001 - a checkpoint without tokenizer files still serves ids
        log.warning("no tokenizer in %s (%s): EOS ids from config.json only, no grammars, "
                    "no stop strings",
                    model_dir, e)
    options = SchedulerOptions.from_config(config, context)
    sched = Scheduler(
        cache,
        runner,
        Sampler(mcfg.vocab_size, device),
        options,
        eos_token_ids=eos,
        sessions=sessions,
        grammars=grammars,
        tokenizer=tokenizer,
    )
    log.info(
        "loaded %s (%s, %d layers, vocab %d) on %s as %s with %s attention in %.1fs",
        model_dir.name, mcfg.model_type, mcfg.num_layers, mcfg.vocab_size, device,
        runner.model.weight_format, runner.attention, time.perf_counter() - t0,
    )  # fmt: skip
    log.info(
        "KV pool: %d tokens of %s (page %d, %.1f MiB reserved, committed as used), context %d, "
        "policy %s, max_running %d, chunked prefill %d, EOS %s",
        capacity, str(kv_dtype).removeprefix("torch."), config.page_size, pool.nbytes / 2**20,
        context, options.policy, options.max_running, options.chunked_prefill, sorted(eos),
    )  # fmt: skip
    for pin in restored_pins:  # re-pinned through the ordinary path (no client waits)
        sched.handle(pin)
    ready = EngineReady(
        model=config.model or "default", context_length=context, page_size=config.page_size,
        kv_capacity=capacity, model_dir=str(model_dir), vocab_size=mcfg.vocab_size,
        state=state.fingerprint if state is not None else "", boot=boot or secrets.token_hex(8),
    )  # fmt: skip
    sched.ready = ready
    return Engine(sched, runner, ready, tp, state)


def _load_state(state: EngineState | None, sessions: SessionManager) -> list[EnginePin]:
    """Durable sessions back (detached, demoted) and the pins to make again."""
    if state is None:
        return []
    rows, pins = state.log.load()
    sessions.durability.load_state(rows)
    log.info("state: %s: %d durable session(s) and %d pin(s) read back", state.folder,
             len(rows), len(pins))
    return [EnginePin(client=b"", rid=f"restore-{i}", name=p.name, input_ids=p.ids.tolist(),
                      namespace=p.namespace) for i, p in enumerate(pins)]


def run_engine(config: EngineConfig, endpoints: Endpoints, boot: str = "") -> None:
    """The engine process's main: serve until Shutdown or SIGTERM. `boot`: the id it
    announced as it started (`EngineBoot`), repeated in its `EngineReady`."""
    engine = build_engine(config, boot=boot)
    sched = engine.scheduler
    # Everything loaded so far (model, tokenizer, libraries: millions of objects) lives as
    # long as the process: out of the collector's way, or every full collection walks it
    # (profiled: ~6% of a batch-1 decode step).
    gc.collect()
    gc.freeze()
    stop = StopFlag()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    ctx: zmq.Context[Any] = zmq.Context()
    inbox = open_socket(ctx, zmq.PULL, endpoints.to_engine, bind=True)
    outbox = open_socket(ctx, zmq.PUSH, endpoints.to_frontend, bind=False)
    if engine.tp is not None:  # a rank that fails stops the engine, which reports why
        engine.tp.on_failure(lambda: setattr(stop, "set", True))
    try:
        outbox.send(encode(engine.ready))
        release_free_memory()  # what loading freed (runtime/memory.py)
        keep_freed_blocks()  # a forward's temporaries reuse the heap from layer to layer
        log.info("engine ready")
        loop = EngineLoop(sched, inbox, outbox, stop)
        sched.sessions.post = loop.intake.put  # committed durable writes answer on the loop
        loop.on_step = _ThroughputLog(sched, loop).maybe_log
        loop.run()
        if engine.tp is not None:
            engine.tp.raise_if_failed()
    finally:
        engine.close()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        inbox.close(linger=0)
        outbox.close(linger=0)
        ctx.term()
        if sched.grammars is not None:
            sched.grammars.close()
        log.info("engine stopped")


class _ThroughputLog:
    """A line every STATS_EVERY_S while busy: throughput over the time the engine spent
    in steps (not over idle time), cache hits, pool use."""

    def __init__(self, sched: Scheduler, loop: EngineLoop) -> None:
        self.sched = sched
        self.loop = loop
        self.t = time.monotonic()
        self.busy = loop.busy_s
        c = sched.counters
        self.last = (c.generated_tokens, c.computed_tokens, c.prompt_tokens, c.cached_tokens)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.t < STATS_EVERY_S:
            return
        s, c = self.sched, self.sched.counters
        cur = (c.generated_tokens, c.computed_tokens, c.prompt_tokens, c.cached_tokens)
        gen, comp, prompt, cached = (a - b for a, b in zip(cur, self.last, strict=True))
        dt, busy = now - self.t, self.loop.busy_s - self.busy
        self.t, self.last, self.busy = now, cur, self.loop.busy_s
        if not (gen or comp or s.has_work()):
            return
        sizes = s.cache.sizes()
        per_s = 1.0 / busy if busy > 0 else 0.0
        log.info(
            "engine: %d running, %d waiting | busy %.1f of %.0f s: decode %.1f tok/s, "
            "prefill %.1f tok/s | cache hit %.1f%% (%d/%d prompt tokens) | pool free %d, "
            "evictable %d, protected %d, private %d | %d retractions",
            len(s.running), len(s.waiting), busy, dt, gen * per_s, comp * per_s,
            100.0 * cached / prompt if prompt else 0.0, cached, prompt,
            sizes.free, sizes.evictable, sizes.protected, s.private_tokens(),
            c.retractions,
        )  # fmt: skip
