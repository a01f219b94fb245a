"""Engine (scheduler) benchmarks, in-process (no sockets):

1. ``overhead``: scheduler time per decode step with 64 running requests, the model's
   time taken out: a stub model returns precomputed random logits instantly, so what is
   left is batching, KV bookkeeping, stop checks and outputs (sampling reported apart).
   Target: < 1 ms per step.
2. ``policies``: a shared-prefix workload (requests over 4 long system prompts, arriving
   in waves) under each schedule policy, stub model, ample and tight pools: prompt
   tokens actually computed and steps taken. This is how the default policy was chosen.
3. ``prefix``: 32 requests over 4 system prompts of 1,000 tokens, 64 new tokens each, on
   SmolLM2 (`resolve_model("default")`): our scheduler vs the same requests through HF
   transformers `generate` one by one. Wall time, prompt tokens computed, ratio.

    .venv/bin/python benchmarks/bench_engine.py                 # all three, CPU
    .venv/bin/python benchmarks/bench_engine.py --part overhead
    .venv/bin/python benchmarks/bench_engine.py --part prefix --device cuda
    # where the default model is not installed: its config.json with random weights
    python3 benchmarks/bench_engine.py --part prefix --device cuda --model-dir CFG_DIR \
        --random-weights

Results and the command go to benchmarks/results_engine.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from radixlm.cache import PrefixCache
from radixlm.cache.pages import align_down
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.policy import POLICIES
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.engine.scheduler import Scheduler
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.wire import EngineGenerate, StepOutputs
from radixlm.runtime.protocol import SamplingParams

RESULTS = Path(__file__).with_name("results_engine.md")
TARGET_STEP_MS = 1.0
VOCAB = 49152  # SmolLM2's


class StubModel:
    """Instant 'forward': a slice of precomputed random logits (one row per request)."""

    def __init__(self, vocab: int, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(rows, vocab, generator=g)
        self.device = torch.device("cpu")
        self.seconds = 0.0

    def forward(self, batch) -> torch.Tensor:
        t = time.perf_counter()
        n = batch.logits_indices.shape[0]
        out = self.logits[:n] if n <= self.logits.shape[0] else self.logits[
            torch.arange(n) % self.logits.shape[0]]
        self.seconds += time.perf_counter() - t
        return out


class TimedSampler(Sampler):
    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.seconds = 0.0

    def sample(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return super().sample(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def _drain(sched: Scheduler) -> int:
    n = 0
    for m in sched.take_outbox():
        if isinstance(m, StepOutputs):
            n += len(m.outputs)
    return n


# ------------------------------------------------------------------ 1. overhead
def bench_overhead(running: int = 64, prompt: int = 512, steps: int = 300,
                   page_size: int = 1) -> dict:
    rng = np.random.default_rng(0)
    capacity = running * (prompt + steps + 64) + 4096
    capacity = align_down(capacity, page_size)
    cache = PrefixCache(capacity, page_size, policy="priority")
    model = StubModel(VOCAB, 4 * running)
    sampler = TimedSampler(VOCAB)
    opt = SchedulerOptions(max_running=running, chunked_prefill=running * prompt,
                           context_length=1 << 20)
    sched = Scheduler(cache, model, sampler, opt, eos_token_ids=[0])
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for k in range(running):
        ids = rng.integers(100, VOCAB, prompt).tolist()
        sched.handle(EngineGenerate(key=k, client=b"b", rid=str(k), input_ids=ids,
                                    sampling=params))
    while not all(r.state is ReqState.DECODING for r in sched.running) or sched.waiting:
        sched.step()
        _drain(sched)
    assert len(sched.running) == running
    for _ in range(10):  # warm-up
        sched.step()
        _drain(sched)
    model.seconds = sampler.seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
        _drain(sched)
    total = time.perf_counter() - t0
    per = lambda s: 1e3 * s / steps  # noqa: E731
    return {
        "running": running, "prompt": prompt, "page_size": page_size, "steps": steps,
        "step_ms": per(total), "model_ms": per(model.seconds), "sample_ms": per(sampler.seconds),
        "sched_ms": per(total - model.seconds - sampler.seconds),
    }  # fmt: skip


# ------------------------------------------------------------------ 2. policies
def _prefix_workload(n_req: int, n_sys: int, sys_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, 40000, sys_len).tolist() for _ in range(n_sys)]
    order = rng.permutation(np.arange(n_req) % n_sys)
    return [systems[i] + rng.integers(100, 40000, int(rng.integers(20, 40))).tolist()
            for i in order]


def bench_policy(policy: str, capacity: int, prompts: list[list[int]], new_tokens: int,
                 wave: int, max_running: int) -> dict:
    cache = PrefixCache(capacity, 1, policy="priority")
    opt = SchedulerOptions(policy=policy, context_length=1 << 20, max_running=max_running)
    sched = Scheduler(cache, StubModel(VOCAB, 256), Sampler(VOCAB), opt, eos_token_ids=[0])
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    steps = 0
    t0 = time.perf_counter()
    while pending or sched.has_work():
        for k, ids in pending[:wave]:  # a wave of arrivals every step
            sched.handle(EngineGenerate(key=k, client=b"b", rid=str(k), input_ids=ids,
                                        sampling=params))
        pending = pending[wave:]
        sched.step()
        _drain(sched)
        steps += 1
    c = sched.counters
    return {"policy": policy, "capacity": capacity, "computed": c.computed_tokens,
            "prompt": c.prompt_tokens, "steps": steps, "retractions": c.retractions,
            "wall_s": time.perf_counter() - t0}


# -------------------------------------------------------------------- 3. prefix
def bench_prefix(device: str, n_req: int = 32, n_sys: int = 4, sys_len: int = 1000,
                 new_tokens: int = 64, hf_requests: int | None = None,
                 model_dir: str | None = None, attention: str = "auto") -> dict:
    from radixlm.runtime.engine.engine_main import build_engine
    from radixlm.runtime.model import resolve_model
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir) if model_dir else resolve_model("default")
    prompts = _prefix_workload(n_req, n_sys, sys_len, seed=1)
    config = EngineConfig(device=device, dtype="float32" if device == "cpu" else "auto",
                          kv_tokens=65536, attention=attention)
    engine = build_engine(config, model_dir)
    attention_name = engine.runner.attention
    sched = engine.scheduler
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours: dict[int, list[int]] = {k: [] for k in range(n_req)}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Warm-up (kernel selection, lazy op registration) outside the timed region, both sides.
    sched.handle(EngineGenerate(key=-1, client=b"b", rid="warm", input_ids=prompts[0][:64],
                                sampling=SamplingParams(max_tokens=2, temperature=0.0)))
    while sched.has_work():
        sched.step()
    sched.take_outbox()
    sched.flush_cache()
    sched.counters.computed_tokens = 0
    sync()
    t0 = time.perf_counter()
    for k, ids in enumerate(prompts):
        sched.handle(EngineGenerate(key=k, client=b"b", rid=str(k), input_ids=ids,
                                    sampling=params))
    while sched.has_work():
        sched.step()
        for m in sched.take_outbox():
            if isinstance(m, StepOutputs):
                for o in m.outputs:
                    ours[o.key].extend(o.token_ids)
    sync()
    ours_s = time.perf_counter() - t0
    computed = sched.counters.computed_tokens
    del engine, sched

    hf_n = n_req if hf_requests is None else min(hf_requests, n_req)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if (Path(model_dir) / "radixlm_source.json").exists():  # a converted GGUF: no weights kept
        from radixlm.runtime.model import ensure_dense_weights

        ensure_dense_weights(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    same = 0
    with torch.no_grad():
        warm = torch.tensor([prompts[0][:64]], device=device)
        hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2,
                    do_sample=False, pad_token_id=0)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for k in range(hf_n):
            ids = torch.tensor([prompts[k]], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            same += out[0, ids.shape[1]:].tolist() == ours[k]
    sync()
    hf_s = (time.perf_counter() - t0) * n_req / hf_n
    return {"device": device, "attention": attention_name, "requests": n_req, "ours_s": ours_s,
            "hf_s": hf_s,
            "hf_measured": hf_n, "ours_computed": computed,
            "hf_computed": sum(len(p) for p in prompts), "same_tokens": same}


def resolve_default() -> Path:
    from radixlm.runtime.model import resolve_model

    return resolve_model("default")


def random_checkpoint(config_dir: Path, device: str) -> Path:
    """`config_dir`'s architecture with random weights (bf16 on CUDA), in a temp dir, with
    its tokenizer files copied beside."""
    import shutil
    import tempfile

    import transformers

    out = Path(tempfile.mkdtemp(prefix="radixlm-bench-"))
    cfg = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(out)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, out / name)
    return out


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["overhead", "policies", "prefix", "all"], default="all")
    ap.add_argument("--device", default="cpu", help="device for the SmolLM2 part")
    ap.add_argument("--hf-requests", type=int, default=None,
                    help="time only this many HF requests and scale (CPU: it is slow)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--model-dir", default=None,
                    help="an HF directory with SmolLM2's architecture instead of the default "
                         "model (e.g. random weights where the GGUF is not installed)")
    ap.add_argument("--random-weights", action="store_true",
                    help="use --model-dir's config.json with random weights (where the real "
                         "weights are not available; timings do not depend on them)")
    ap.add_argument("--attention", default="auto", help="attention backend for our engine")
    ap.add_argument("--results", default=str(RESULTS), help="where to write the results")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = [
        "# Engine (scheduler) benchmark", "",
        f"Command: `.venv/bin/python benchmarks/bench_engine.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, python {platform.python_version()}",
        "",
    ]  # fmt: skip

    if args.part in ("overhead", "all"):
        lines += ["## Scheduler time per decode step (model stubbed out)", "",
                  "| running | prompt | page | step total ms | model (stub) ms | sampling ms | "
                  "**scheduler ms** | target |", "|---|---|---|---|---|---|---|---|"]
        for page in (1, 16):
            r = bench_overhead(page_size=page)
            ok = "ok" if r["sched_ms"] < TARGET_STEP_MS else "MISSED"
            row = (f"| {r['running']} | {r['prompt']} | {page} | {r['step_ms']:.3f} | "
                   f"{r['model_ms']:.3f} | {r['sample_ms']:.3f} | **{r['sched_ms']:.3f}** | "
                   f"< {TARGET_STEP_MS} ms ({ok}) |")
            print(row, flush=True)
            lines.append(row)
        lines += ["", "Sampling is greedy argmax over SmolLM2's 49,152-entry vocabulary for 64 "
                  "rows on the CPU; on a GPU it is one kernel.", ""]

    if args.part in ("policies", "all"):
        lines += ["## Schedule policies on a shared-prefix workload (stub model)", "",
                  "96 requests over 8 system prompts of 1,000 tokens in random order (+20-40 "
                  "own tokens each), 32 new tokens each; arrivals all at once (burst) or 4 per "
                  "step (waves). Computed = prompt tokens actually run through the model.", "",
                  "| pool tokens | max running | arrivals | policy | prompt tokens | computed | "
                  "steps | retractions |", "|---|---|---|---|---|---|---|---|"]
        prompts = _prefix_workload(96, 8, 1000, seed=2)
        for capacity, max_running, wave in ((131072, 64, 4), (131072, 64, 96), (6000, 8, 96),
                                            (4000, 16, 4)):
            for policy in POLICIES:
                r = bench_policy(policy, capacity, prompts, 32, wave, max_running)
                arrivals = "burst" if wave >= len(prompts) else f"{wave}/step"
                row = (f"| {capacity} | {max_running} | {arrivals} | {policy} | {r['prompt']} | "
                       f"{r['computed']} | {r['steps']} | {r['retractions']} |")
                print(row, flush=True)
                lines.append(row)
        lines.append("")

    if args.part in ("prefix", "all"):
        if args.random_weights:
            args.model_dir = str(random_checkpoint(Path(args.model_dir or resolve_default()),
                                                   args.device))
        r = bench_prefix(args.device, hf_requests=args.hf_requests, model_dir=args.model_dir,
                         attention=args.attention)
        scaled = "" if r["hf_measured"] == r["requests"] else (
            f" (HF timed on {r['hf_measured']} requests, scaled to {r['requests']})")
        weights = " (random weights)" if args.random_weights else ""
        lines += [f"## Shared-prefix workload on SmolLM2-135M{weights} ({r['device']}, "
                  f"{r['attention']} attention){scaled}", "",
                  "32 requests over 4 system prompts of 1,000 tokens, 64 new tokens each "
                  "(greedy).", "",
                  "| | wall s | prompt tokens computed |", "|---|---|---|",
                  f"| radixlm scheduler (in-process) | {r['ours_s']:.2f} | {r['ours_computed']} |",
                  f"| HF transformers generate, one by one | {r['hf_s']:.2f} | "
                  f"{r['hf_computed']} |",
                  f"| ratio (HF / ours) | {r['hf_s'] / r['ours_s']:.1f}x | "
                  f"{r['hf_computed'] / max(r['ours_computed'], 1):.1f}x |", "",
                  f"Greedy outputs identical to HF's: {r['same_tokens']} of {r['hf_measured']}.",
                  ""]  # fmt: skip
        print("\n".join(lines[-9:]), flush=True)

    out = Path(args.results)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
