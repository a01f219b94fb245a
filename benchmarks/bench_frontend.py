"""Frontend protocol overhead, with the model's time taken out.

The real frontend process runs against a stub engine process that answers every
`EngineGenerate` with one token per request per "step", as fast as it can (no model): all
the work measured is the frontend's (decode, route, detokenize, encode, ROUTER send) plus
ZeroMQ. One client DEALER sends N streaming requests at once and counts
the `Chunk`s that arrive; the figure is chunks per second from the first request sent to
the last `Done` received.

    .venv/bin/python benchmarks/bench_frontend.py            # 64 requests x 512 tokens
    .venv/bin/python benchmarks/bench_frontend.py --requests 64 --tokens 512 --tokenizer tiny

Each run measures twice: without stop strings, then with one stop string per request
(stop strings are matched by the engine, so the stub never matches them: the second row
shows that they cost the frontend nothing).

Target: >= 20,000 chunks/s. Results and the command go to benchmarks/results_frontend.md.
(``bench_frontend.py stub-engine SPEC PARENT_PID`` is the stub engine's own entry.)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import zmq
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.wire import (
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineReady,
    StepOutputs,
    ToClient,
    TokenOutput,
    to_engine_decoder,
)
from radixlm.runtime.protocol import Done, Error, Generate, Input, SamplingParams, Usage
from radixlm.runtime.protocol import encode as encode_reply
from radixlm.runtime.server.child import die_with_parent
from radixlm.runtime.server.launcher import start_server
from radixlm.runtime.server.spec import load_spec
from radixlm.runtime.transport import channel
from radixlm.runtime.transport.channel import open_socket
from radixlm.runtime.transport.raw_client import RawClient

TARGET_CHUNKS_PER_S = 20_000
RESULTS = Path(__file__).with_name("results_frontend.md")
STUB_TEXT = (
    "The quick brown fox jumps over the lazy dog. A radix tree keeps every prompt prefix, "
    "so each new turn only computes its new tokens. "
)


# -- the stub engine -------------------------------------------------------------------------


class _Stub:
    def __init__(self, token_cycle: list[int]) -> None:
        self.cycle = token_cycle
        self.active: dict[int, list[Any]] = {}  # key -> [client, produced, max_tokens, prompt_len]

    def handle(self, msg: Any, push: zmq.Socket[Any]) -> None:
        if isinstance(msg, EngineGenerate):
            self.active[msg.key] = [msg.client, 0, msg.sampling.max_tokens, len(msg.input_ids)]
        elif isinstance(msg, EngineAbort):
            state = self.active.pop(msg.key, None)
            if state is not None:
                channel.send(push, StepOutputs(outputs=[self._last(msg.key, state, state[1], "abort")]))
        elif isinstance(msg, ClientGone):
            for key in [k for k, s in self.active.items() if s[0] == msg.client]:
                del self.active[key]
        elif isinstance(msg, EngineCommand):
            reply = Error(rid=getattr(msg.msg, "rid", None), code="internal",
                          message="the stub engine answers generate only")
            channel.send(push, ToClient(client=msg.client, data=encode_reply(reply)))

    @staticmethod
    def _last(key: int, state: list[Any], produced: int, reason: str) -> TokenOutput:
        return TokenOutput(key=key, token_ids=[], finish_reason=reason,
                           usage=Usage(prompt_tokens=state[3], cached_tokens=0,
                                       completion_tokens=produced))

    def step(self) -> StepOutputs:
        outputs = []
        for key, state in list(self.active.items()):
            token = self.cycle[state[1] % len(self.cycle)]
            state[1] += 1
            out = TokenOutput(key=key, token_ids=[token])
            if state[1] >= state[2]:
                out.finish_reason = "length"
                out.usage = Usage(prompt_tokens=state[3], cached_tokens=0, completion_tokens=state[1])
                del self.active[key]
            outputs.append(out)
        return StepOutputs(outputs=outputs)


def stub_engine_main(spec: str, parent_pid: int) -> int:
    """The engine role of the launcher, without a model: one token per request per step."""
    die_with_parent(parent_pid)
    config, endpoints = load_spec(spec)
    from radixlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(config.model)
    ctx: zmq.Context[Any] = zmq.Context()
    pull = open_socket(ctx, zmq.PULL, endpoints.to_engine, bind=True)
    push = open_socket(ctx, zmq.PUSH, endpoints.to_frontend, bind=False)
    channel.send(push, EngineReady(model="stub-engine", context_length=1 << 20, page_size=1,
                                 kv_capacity=1 << 20, model_dir=config.model,
                                 vocab_size=tokenizer.vocab_size))
    stub = _Stub(tokenizer.encode(STUB_TEXT))
    try:
        while True:
            if not stub.active:
                pull.poll()
            while True:
                try:
                    data = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                stub.handle(to_engine_decoder.decode(data), push)
            if stub.active:
                channel.send(push, stub.step())
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


# -- the measurement -------------------------------------------------------------------------


def tokenizer_dir(kind: str, scratch: Path) -> str:
    if kind == "default":
        from radixlm.runtime.model.resolve import resolve_model

        return str(resolve_model("default"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import make_tiny_tokenizer

    make_tiny_tokenizer(scratch / "tiny")
    return str(scratch / "tiny")


class Burst(NamedTuple):
    chunks: int
    seconds: float
    longest_gap_ms: float
    frontend_cpu_s: float  # the frontend process's CPU time (all its threads) in the burst

    @property
    def rate(self) -> float:
        return self.chunks / self.seconds

    @property
    def cpu_us_per_chunk(self) -> float:
        return self.frontend_cpu_s / self.chunks * 1e6


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(client: RawClient, frontend_pid: int, requests: int, tokens: int,
             stop: bool) -> Burst:
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True,
                              stop=["<never matches>"] if stop else [])
    rids = [client.new_rid("bench") for _ in range(requests)]
    chunks = 0
    done = 0
    longest_gap = 0.0
    cpu0 = cpu_seconds(frontend_pid)
    t0 = time.perf_counter()
    last = t0
    for rid in rids:
        client.send(Generate(rid=rid, input=Input(text="Hello there, stub engine."),
                             sampling=sampling, stream=True))
    while done < requests:
        msg = client.recv()
        now = time.perf_counter()
        longest_gap = max(longest_gap, now - last)
        last = now
        if isinstance(msg, Done):
            done += 1
        elif isinstance(msg, Error):
            raise RuntimeError(f"request failed: {msg}")
        else:
            chunks += 1
    seconds = time.perf_counter() - t0
    return Burst(chunks, seconds, longest_gap * 1000, cpu_seconds(frontend_pid) - cpu0)


def measure(client: RawClient, frontend_pid: int, args: argparse.Namespace,
            stop: bool) -> tuple[Burst, float]:
    """The fastest of `args.repeats` bursts, and the least frontend CPU per chunk seen."""
    run_once(client, frontend_pid, 8, 16, stop)  # warm-up
    bursts = [run_once(client, frontend_pid, args.requests, args.tokens, stop)
              for _ in range(args.repeats)]
    return max(bursts, key=lambda b: b.rate), min(b.cpu_us_per_chunk for b in bursts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="concurrent streaming requests")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="bursts measured (best is kept)")
    parser.add_argument("--tokenizer", choices=("default", "tiny"), default="default",
                        help="SmolLM2's 49k BPE (default) or the tests' tiny BPE")
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = tokenizer_dir(args.tokenizer, Path(scratch))
        config = EngineConfig(model=model_dir, log_level="warning")
        server = start_server(config, start_timeout_s=120,
                              engine_command=[sys.executable, __file__, "stub-engine"])
        try:
            frontend = server.pids["frontend"]
            with RawClient(server.endpoint, timeout_s=60) as client:
                plain, plain_cpu = measure(client, frontend, args, stop=False)
                stops, stops_cpu = measure(client, frontend, args, stop=True)
        finally:
            server.stop()

    load = os.getloadavg()[0]
    rows = [
        ("streamed chunks/s", f"{plain.rate:,.0f}", f"{stops.rate:,.0f}",
         f"{TARGET_CHUNKS_PER_S:,}"),
        ("frontend CPU per chunk", f"{plain_cpu:.1f} us", f"{stops_cpu:.1f} us",
         f"{1e6 / TARGET_CHUNKS_PER_S:.0f} us"),
        ("one frontend core's capacity", f"{1e6 / plain_cpu:,.0f}/s", f"{1e6 / stops_cpu:,.0f}/s",
         f"{TARGET_CHUNKS_PER_S:,}/s"),
        ("longest inter-chunk gap", f"{plain.longest_gap_ms:.1f} ms",
         f"{stops.longest_gap_ms:.1f} ms", ""),
        ("chunks per burst", f"{plain.chunks:,}", f"{stops.chunks:,}", ""),
    ]
    header = ("", "no stop strings", "1 stop string", "target")
    print(f"{header[0]:30}{header[1]:>17}{header[2]:>15}{header[3]:>10}")
    for name, a, b, target in rows:
        print(f"{name:30}{a:>17}{b:>15}{target:>10}")
    verdict = "meets" if plain.rate >= TARGET_CHUNKS_PER_S else "MISSES"
    print(f"streamed chunks/s (no stop strings) {verdict} the target; load average {load:.1f} "
          f"on {os.cpu_count()} CPUs shared by the stub engine, the frontend and the client")
    if not args.no_write:
        command = " ".join(["benchmarks/bench_frontend.py", *sys.argv[1:]])
        RESULTS.write_text(
            "# Frontend protocol overhead (stub engine, no model)\n\n"
            f"Command: `.venv/bin/python {command}`\n\n"
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), load average {load:.1f} "
            f"at the end of the run, {platform.python_implementation()} "
            f"{platform.python_version()}. {args.requests} concurrent streaming requests x "
            f"{args.tokens} tokens from one client DEALER; tokenizer: {args.tokenizer}; best of "
            f"{args.repeats} bursts. The stub engine, the frontend and the client share the "
            "CPUs. \"Frontend CPU per chunk\" is the frontend process's CPU time (all its "
            "threads, ZeroMQ's I/O thread included) divided by the chunks it sent; \"one "
            "frontend core's capacity\" is its inverse.\n\n"
            f"| figure | {header[1]} | {header[2]} | target |\n|---|---:|---:|---:|\n"
            + "".join(f"| {name} | {a} | {b} | {t} |\n" for name, a, b, t in rows)
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "stub-engine":
        sys.exit(stub_engine_main(sys.argv[2], int(sys.argv[3])))
    sys.exit(main())
