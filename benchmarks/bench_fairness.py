"""Fairness between clients, on a real server (engine + frontend, the embedded default
model on CPU unless told otherwise).

1. Client B sends 8-token requests one after another: its latency alone (the baseline),
   then while client A floods the server with 256 streaming requests. Target: under the
   flood, B's latency <= 3x the baseline.
2. Control requests during a long prefill: A sends a ~4k-token prompt; B sends `stats`
   one after another until A's answer comes: their latency. Target: < 100 ms.

    .venv/bin/python benchmarks/bench_fairness.py
    .venv/bin/python benchmarks/bench_fairness.py --model PATH --threads 2

Baseline before the fairness work (issue 14's probe): under the flood, B's 8-token
request did not finish in 120 s; a `stats` waited 33 s behind a 3.2k-token prefill.
Results go to benchmarks/results_fairness.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import zmq
from bench_frames import append_results  # (benchmarks/ is the script's own directory)
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.launcher import start_server
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Done,
    Generate,
    GetStats,
    Hello,
    Input,
    SamplingParams,
    Tokenize,
    Tokens,
    decode_server,
    encode,
)
from radixlm.runtime.raw_client import RawClient

RESULTS = Path(__file__).with_name("results_fairness.md")
FLOOD = 256
PROBES = 5


def short_latencies(client: RawClient, n: int) -> list[float]:
    out = []
    for i in range(n):
        started = time.perf_counter()
        client.generate(Input(text=f"Say a number: {i}"), max_tokens=8, temperature=0.0,
                        ignore_eos=True)
        out.append(time.perf_counter() - started)
    return out


def count_tokens(client: RawClient, text: str) -> int:
    reply = client.call(Tokenize(rid=client.new_rid("t"), input=Input(text=text)))
    assert isinstance(reply, Tokens), reply
    return len(reply.input_ids)


def long_prompt(client: RawClient, tokens: int) -> str:
    """Text of close to `tokens` tokens (at most that many) for this model's tokenizer."""
    words = tokens
    while True:  # shrink until it fits ...
        text = " ".join(f"w{i}" for i in range(words))
        n = count_tokens(client, text)
        if n <= tokens:
            break
        words = max(1, int(words * tokens / n * 0.98))
    while n < tokens * 0.99:  # ... then grow back towards the target
        grown = words + max(1, int((tokens - n) * words / n * 0.9))  # words per token so far
        more = " ".join(f"w{i}" for i in range(grown))
        m = count_tokens(client, more)
        if m > tokens:
            break
        text, n, words = more, m, grown
    return text


def flooder(endpoint: str) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
    assert sock.poll(60_000)
    sock.recv()
    return ctx, sock


def run(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    config = EngineConfig(model=args.model, device="cpu", kv_tokens=args.kv_tokens,
                          threads=args.threads, log_level="warning",
                          fair_step_factor=args.fair_step_factor)
    rows = []
    with start_server(config) as server, RawClient(server.endpoint, timeout_s=600) as b:
        short_latencies(b, 1)  # warm-up
        alone = statistics.median(short_latencies(b, PROBES))
        ctx, a = flooder(server.endpoint)
        try:
            for i in range(FLOOD):
                a.send(encode(Generate(rid=f"flood{i}", input=Input(text=f"Story {i}:"),
                                       stream=True, sampling=SamplingParams(
                                           max_tokens=args.flood_tokens, ignore_eos=True))))
            assert a.poll(120_000)  # the flood is running
            before, t0 = b.stats(), time.perf_counter()
            flooded = short_latencies(b, PROBES)
            after, elapsed = b.stats(), time.perf_counter() - t0
        finally:
            a.close(0)  # the server aborts the rest of the flood
            ctx.term()
        ratio = statistics.median(flooded) / alone
        rows.append(("8-token request, alone (median of 5)", f"{alone:.3f} s", "baseline", ""))
        rows.append((f"8-token request during a {FLOOD}-request flood (median of 5; max "
                     f"{max(flooded):.2f} s)", f"{statistics.median(flooded):.3f} s",
                     f"{ratio:.1f}x alone", "<= 3x: " + ("met" if ratio <= 3 else "NOT met")))
        flood_tokens = (after.generated_tokens_total - before.generated_tokens_total  # type: ignore[attr-defined]
                        - PROBES * 8)
        capped = after.capped_steps - before.capped_steps  # type: ignore[attr-defined]
        rows.append(("the flood's decode throughput meanwhile (tok/s)",
                     f"{flood_tokens / elapsed:.0f}", f"{capped} capped steps, "
                     f"{after.fair_preemptions - before.fair_preemptions} fair-share "  # type: ignore[attr-defined]
                     "retractions", ""))
        while b.stats().running:  # the flood's aborts land
            time.sleep(0.1)
        ctx, a = flooder(server.endpoint)
        try:
            prompt = long_prompt(b, args.prefill_tokens)
            n_prompt = count_tokens(b, prompt)
            a.send(encode(Generate(rid="long", input=Input(text=prompt),
                                   sampling=SamplingParams(max_tokens=1))))
            latencies = []
            while True:
                started = time.perf_counter()
                reply = b.call(GetStats(rid=b.new_rid("s")))
                latencies.append(time.perf_counter() - started)
                if a.poll(0) and isinstance(decode_server(a.recv()), Done):
                    break
            tokens = reply.prompt_tokens_total  # type: ignore[attr-defined]
        finally:
            a.close(0)
            ctx.term()
        worst = max(latencies)
        rows.append((f"stats during a long prefill (prompt {n_prompt} tokens; "
                     f"{len(latencies)} stats, median {statistics.median(latencies) * 1000:.0f} "
                     f"ms; server prompt tokens so far {tokens})", f"{worst * 1000:.0f} ms max",
                     "", "< 100 ms: " + ("met" if worst < 0.1 else "NOT met")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=32768)
    parser.add_argument("--flood-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4000,
                        help="tokens of the long prompt")
    parser.add_argument("--fair-step-factor", type=float, default=EngineConfig().fair_step_factor,
                        help="the server's --fair-step-factor (0: whole batches, the baseline)")
    args = parser.parse_args()
    rows = run(args)
    table = "\n".join(["| measure | value | vs | target |", "|---|---|---|---|",
                       *("| " + " | ".join(r) + " |" for r in rows)])
    command = (f"  .venv/bin/python benchmarks/bench_fairness.py --model {args.model} --threads "
               f"{args.threads} --flood-tokens {args.flood_tokens} --prefill-tokens "
               f"{args.prefill_tokens} --kv-tokens {args.kv_tokens} --fair-step-factor "
               f"{args.fair_step_factor:g}")
    append_results(RESULTS, "Fairness", args.model, command, table)


if __name__ == "__main__":
    main()
