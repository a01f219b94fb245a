"""What the preemptible prefill (runtime/engine/slicing.py) costs a long prompt alone: the
same prompt prefilled in chunks, one forward per chunk (`ModelRunner.forward`, the
baseline) against the chunk run as a `SlicedPrefill` advanced `--slice-ms` at a time
(what the engine does, without the serving loop between slices). The two alternate for
`--rounds` rounds so that a shared machine's load drifts over both alike; also the
longest slice (how long a newcomer may wait for the loop).

    .venv/bin/python benchmarks/bench_prefill_slices.py --tokens 5970 --rounds 3
Results go to benchmarks/results_fairness.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

# As the engine process runs (EngineConfig.omp_wait_policy, set before torch loads
# OpenMP): with OpenMP's default (active) policy on a shared machine every parallel
# region waits for a descheduled spinning thread, and slicing's many smaller regions
# measured 2-2.7x slower there (passive: no slower).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import numpy as np  # noqa: E402
from bench_frames import append_results  # noqa: E402 - benchmarks/ is the script's own directory
from radixlm.runtime.config import EngineConfig  # noqa: E402
from radixlm.runtime.engine.engine_main import build_engine  # noqa: E402
from radixlm.runtime.engine.options import SchedulerOptions  # noqa: E402

RESULTS = Path(__file__).with_name("results_fairness.md")


def prefill(runner, tokens: np.ndarray, chunk: int, slice_s: float | None,
            rows: int) -> tuple[float, float, int]:
    """Seconds for the whole prompt, the longest single call, and calls made."""
    from radixlm.runtime.model.batch import pack_forward_batch

    n = len(tokens)
    slots = np.arange(n, dtype=np.int64)
    longest, calls = 0.0, 0
    t0 = time.perf_counter()
    for kv in range(0, n, chunk):
        ext = min(chunk, n - kv)
        if slice_s is None:
            t = time.perf_counter()
            runner.forward(pack_forward_batch([tokens], [slots], np.array([kv]), np.array([ext]),
                                              np.array([ext - 1]), runner.device))
            longest, calls = max(longest, time.perf_counter() - t), calls + 1
            continue
        task = runner.start_sliced(tokens, slots, kv, ext, ext - 1, rows)
        done = None
        while done is None:
            t = time.perf_counter()
            done = task.advance(slice_s)
            longest, calls = max(longest, time.perf_counter() - t), calls + 1
    return time.perf_counter() - t0, longest, calls


def main() -> None:
    opt = SchedulerOptions()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="model (default: SmolLM2-135M GGUF)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--tokens", type=int, default=5970, help="prompt tokens of the long prompt")
    p.add_argument("--chunk", type=int, default=opt.chunked_prefill,
                   help="prompt tokens per prefill chunk (the engine's --chunked-prefill)")
    p.add_argument("--slice-ms", type=float, default=opt.prefill_slice_ms,
                   help="time per slice (the engine's --prefill-slice-ms)")
    p.add_argument("--rows", type=int, default=opt.prefill_slice_rows,
                   help="rows of one layer piece")
    p.add_argument("--rounds", type=int, default=3, help="interleaved A/B rounds (median)")
    args = p.parse_args()
    engine = build_engine(EngineConfig(model=args.model, device="cpu", threads=args.threads,
                                       kv_tokens=args.tokens + 64, log_level="warning"))
    runner = engine.runner
    tokens = np.random.default_rng(0).integers(100, 40000, args.tokens).astype(np.int64)
    prefill(runner, tokens[:300], args.chunk, None, args.rows)  # warm-up
    base, sliced, longest, calls = [], [], 0.0, 0
    for _ in range(args.rounds):
        base.append(prefill(runner, tokens, args.chunk, None, args.rows)[0])
        s, lg, c = prefill(runner, tokens, args.chunk, args.slice_ms / 1000, args.rows)
        sliced.append(s)
        longest, calls = max(longest, lg), c
    b, s = statistics.median(base), statistics.median(sliced)
    load = os.getloadavg()
    table = "\n".join([
        "| measure | value | vs | target |", "|---|---|---|---|",
        f"| {args.tokens}-token prompt alone, one forward per {args.chunk}-token chunk "
        f"(median of {args.rounds}: {', '.join(f'{x:.1f}' for x in base)}) | {b:.2f} s | "
        "baseline | |",
        f"| ... in {args.slice_ms:g} ms slices of {args.rows}-row layer pieces "
        f"(median of {args.rounds}: {', '.join(f'{x:.1f}' for x in sliced)}; {calls} slices, "
        f"the longest {1e3 * longest:.0f} ms) | {s:.2f} s | {s / b:.2f}x | <= 1.10x: "
        f"{'met' if s / b <= 1.10 else 'NOT met'} |",
    ])  # fmt: skip
    command = (f"  OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} .venv/bin/python benchmarks/bench_prefill_slices.py --model {args.model} "
               f"--threads {args.threads} --tokens {args.tokens} --chunk {args.chunk} "
               f"--slice-ms {args.slice_ms:g} --rows {args.rows} --rounds {args.rounds}\n\n"
               f"  load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
               f"({os.cpu_count()} cores, shared)")
    append_results(RESULTS, "Preemptible prefill: a long prompt alone", args.model, command,
                   table)



if __name__ == "__main__":
    main()
