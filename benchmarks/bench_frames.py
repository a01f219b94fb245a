"""Bounded input: what huge frames cost the frontend.

A real server (engine + frontend) on the embedded default model; a raw DEALER sends one
`generate` whose text is N MB. With the frame limit (``--max-message-bytes``, default
4 MiB) libzmq drops the connection while reading the frame: the client's "answer" is the
disconnect, seen by its socket monitor. A frame under the limit whose text cannot fit the
context is answered ``too_long`` before tokenizing. For each case: the time to the
answer and the frontend's RSS growth (VmRSS after minus before, and the peak VmHWM).
Another client's short request is timed right after each, to show the server serves on.

    .venv/bin/python benchmarks/bench_frames.py                 # 10 MB, 50 MB, 3 x 8 MB, 3 MB
    .venv/bin/python benchmarks/bench_frames.py --model PATH

Targets (issue 14): 10 MB and 50 MB frames answered in < 1 s, frontend RSS growth
< 50 MB. Baseline (the issue's probe, before the limit): 10 MB tokenized for 31 s (1.95 GB
peak), 50 MB: no reply in 4 minutes (8.96 GB). Results go to benchmarks/results_frames.md.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path
from typing import Any

import zmq
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Generate,
    Hello,
    Input,
    decode_server,
    encode,
)
from radixlm.runtime.server.launcher import start_server
from radixlm.runtime.transport.raw_client import RawClient
from zmq.utils.monitor import recv_monitor_message

RESULTS = Path(__file__).with_name("results_frames.md")
MB = 10**6


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def send_huge(endpoint: str, sizes: list[int]) -> tuple[float, str]:
    """Send one frame per size (from as many clients, at once); the time until every one
    was answered (a disconnect or a reply) and what the answers were."""
    ctx = zmq.Context()
    socks, monitors = [], []
    try:
        for _ in sizes:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.connect(endpoint)
            sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
            assert sock.poll(60_000), "no welcome"
            sock.recv()
            socks.append(sock)
        frames = [encode(Generate(rid=f"huge{i}", input=Input(text="x" * size)))
                  for i, size in enumerate(sizes)]
        started = time.perf_counter()
        for sock, frame in zip(socks, frames, strict=True):
            sock.send(frame)
        answers: list[str] = []
        poller = zmq.Poller()
        for sock, monitor in zip(socks, monitors, strict=True):
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
        pending = set(range(len(sizes)))
        while pending:
            ready = dict(poller.poll(300_000))
            assert ready, "no answer within 300 s"
            for i in list(pending):
                if monitors[i] in ready and recv_monitor_message(monitors[i])["event"] == \
                        zmq.EVENT_DISCONNECTED:
                    answers.append("disconnected")
                    pending.discard(i)
                elif socks[i] in ready:
                    reply = decode_server(socks[i].recv())
                    answers.append(getattr(reply, "code", type(reply).__name__))
                    pending.discard(i)
        return time.perf_counter() - started, ", ".join(sorted(set(answers)))
    finally:
        for sock in socks:
            sock.disable_monitor()
            sock.close(0)
        for monitor in monitors:
            monitor.close(0)
        ctx.term()


def short_request_s(endpoint: str) -> float:
    started = time.perf_counter()
    with RawClient(endpoint, timeout_s=120) as client:
        client.generate(Input(text="Hello"), max_tokens=4, temperature=0.0)
    return time.perf_counter() - started


def run(args: argparse.Namespace, max_message_bytes: int) -> list[tuple[Any, ...]]:
    config = EngineConfig(model=args.model, device="cpu", kv_tokens=4096, threads=args.threads,
                          max_message_bytes=max_message_bytes, log_level="warning")
    rows = []
    with start_server(config) as server:
        frontend = server.pids["frontend"]
        cases = [("10 MB", [10 * MB]), ("50 MB", [50 * MB]), ("3 x 8 MB at once", [8 * MB] * 3),
                 ("3 MB (under the limit)", [3 * MB])]
        for name, sizes in cases:
            if max_message_bytes == 0 and sum(sizes) > args.unlimited_max:
                continue
            before = rss_kib(frontend)
            seconds, answer = send_huge(server.endpoint, sizes)
            time.sleep(0.5)  # let freed buffers go back before reading RSS
            after, peak = rss_kib(frontend), rss_kib(frontend, "VmHWM")
            rows.append((max_message_bytes or "none", name, f"{seconds:.3f}", answer,
                         f"{(after - before) / 1024:.1f}", f"{peak / 1024:.0f}",
                         f"{short_request_s(server.endpoint):.2f}"))
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--unlimited-max", type=int, default=60 * MB,
                        help="largest total sent to a server without a frame limit")
    args = parser.parse_args()
    rows = run(args, EngineConfig().max_message_bytes)
    rows += run(args, 0)  # the text bound alone: the frame is read, the text refused at once
    header = ("| frame limit (bytes) | frame | answered in (s) | answer | frontend RSS growth "
              "(MB) | frontend peak RSS (MB) | next request (s) |\n|---|---|---|---|---|---|---|")
    table = "\n".join([header, *("| " + " | ".join(str(c) for c in r) + " |" for r in rows)])
    command = "  .venv/bin/python benchmarks/bench_frames.py" + (
        f" --model {args.model}" if args.model != "default" else "")
    append_results(RESULTS, "Frames", args.model, command, table)


def append_results(path: Path, title: str, model: str, command: str, table: str) -> None:
    """Append a dated section (title, machine, model, the command, the table) to `path`
    and print it (bench_fairness.py uses this too)."""
    text = (f"## {title} ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, model "
            f"{model})\n\n{command}\n\n{table}\n\n")
    with path.open("a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
