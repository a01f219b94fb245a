#!/usr/bin/env python3
"""Durable sessions across a restart: the next turn after `radixlm serve` restarts, against
the same turn on a hot server and against recomputing the history.

Workload (SmolLM2-135M-Instruct as shipped, greedy): 8 durable sessions, each opened with
a ~4,000-token history of random words (token ids, no template) and one 32-token reply.
Then, for every session, the same next turn (a 60-token message, 1 new token: its time is
the time to first token) is timed:

  hot        on the server that made the sessions (a fork of each, so the history is
             unchanged for the next rows): the history is held in the device cache;
  restart    after the server is stopped and a new one started on the same state
             directory: the session is resumed by id and its KV read back from the disk
             tier (only the tail past the last whole 64-token block is computed again);
  recompute  the same prompt as a plain request under a fresh namespace: the whole
             history computed again (what a restart costs without a disk tier);
  llama-server (opt-in, --peer): its slot save / restore of the same history on the
             same GGUF (`--slot-save-path`, POST /slots/0?action=save|restore) across a
             restart of llama-server, then the same turn (the anchor: a file per slot,
             saved and restored only when asked).

Also: restart to ready (process start to the endpoint answering), and the disk tier's
size. Targets (issue 38): restart within 2x of hot, at least 10x faster than recompute,
restart to ready under 5 s.

    .venv/bin/python benchmarks/bench_durable.py [--sessions 8] [--history 4000] [--peer]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from radixlm.runtime.protocol import (
    CloseSession,
    ForkSession,
    Generate,
    Input,
    OpenSession,
    ResumeSession,
    SamplingParams,
    SessionOpened,
    SessionsForked,
)
from radixlm.runtime.transport.raw_client import RawClient

HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 600.0
SAMPLING = dict(temperature=0.0, ignore_eos=True)


@contextmanager
def server(workdir: Path, state: Path, threads: int, kv_tokens: int) -> Iterator[tuple[str, float]]:
    """``radixlm serve`` on the shipped model with `state`; yields (endpoint, seconds from
    the process start to its endpoint answering)."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint_file = workdir / "endpoint"
    endpoint_file.unlink(missing_ok=True)
    log = (workdir / "serve.log").open("ab")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--no-http", "--threads",
         str(threads), "--kv-tokens", str(kv_tokens), "--state-dir", str(state),
         "--endpoint", f"ipc://{workdir}/s.sock", "--endpoint-file", str(endpoint_file)],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while not endpoint_file.exists():
            if proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT_S:
                sys.exit(f"radixlm serve failed: see {workdir / 'serve.log'}")
            time.sleep(0.02)
        endpoint = endpoint_file.read_text().strip()
        with RawClient(endpoint, timeout_s=60) as c:
            c.stats()
        yield endpoint, time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def history_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def timed_turn(c: RawClient, message: list[int], session: str | None = None,
               namespace: str | None = None) -> tuple[float, int]:
    """Seconds to the first (and only) token of one turn, and its computed tokens."""
    rid = c.new_rid("t")
    t = time.perf_counter()
    c.send(Generate(rid=rid, input=Input(input_ids=message), session=session,
                    namespace=namespace, sampling=SamplingParams(max_tokens=1, **SAMPLING)))
    [done] = c.collect(rid)
    elapsed = time.perf_counter() - t
    computed = done.usage.prompt_tokens - done.usage.cached_tokens
    return elapsed, computed


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def peer_restore(histories: list[list[int]], messages: list[list[int]], threads: int,
                 workdir: Path) -> list[float]:
    """llama-server's slot save/restore of each history across its own restart."""
    sys.path.insert(0, str(HERE))
    import bench_peer as bp  # the llama-server build and process helpers
    from radixlm.runtime.model.resolve import default_gguf_path

    binary = bp.ensure_llama_server(bp.peer_dir(), 2)
    gguf = default_gguf_path()
    slots = workdir / "slots"
    slots.mkdir(exist_ok=True)

    def start() -> tuple[subprocess.Popen[bytes], str]:
        port = bp._free_port()
        proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "-t", str(threads), "-tb", str(threads), "--parallel", "1", "-c", "8192",
             "--slot-save-path", str(slots)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.1)

    def post(url: str, path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    times = []
    for i, (hist, msg) in enumerate(zip(histories, messages, strict=True)):
        proc, url = start()
        post(url, "/completion", {"prompt": hist, "n_predict": 1, "id_slot": 0,
                                  "cache_prompt": True, "temperature": 0})
        post(url, "/slots/0?action=save", {"filename": f"s{i}.bin"})
        proc.terminate()
        proc.wait()
        proc, url = start()
        t = time.perf_counter()
        post(url, "/slots/0?action=restore", {"filename": f"s{i}.bin"})
        post(url, "/completion", {"prompt": hist + msg, "n_predict": 1, "id_slot": 0,
                                  "cache_prompt": True, "temperature": 0})
        times.append(time.perf_counter() - t)
        proc.terminate()
        proc.wait()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8, help="durable sessions (default 8)")
    ap.add_argument("--history", type=int, default=4000, help="history tokens of each")
    ap.add_argument("--message", type=int, default=60, help="tokens of the timed turn's message")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server")
    ap.add_argument("--peer", action="store_true",
                    help="also time llama-server's slot restore (builds it once, ~18 min)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the result as markdown here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    vocab = 49152  # SmolLM2's
    histories = [history_ids(rng, vocab, args.history) for _ in range(args.sessions)]
    messages = [history_ids(rng, vocab, args.message) for _ in range(args.sessions)]
    kv_tokens = args.sessions * (2 * args.history + 256) + 8192
    work = Path(tempfile.mkdtemp(prefix="bench-durable-"))
    state = work / "state"
    rows: dict[str, list[float]] = {"hot": [], "restart": [], "recompute": []}
    computed: dict[str, list[int]] = {"hot": [], "restart": [], "recompute": []}
    try:
        with server(work / "one", state, args.threads, kv_tokens) as (endpoint, _), \
                RawClient(endpoint, timeout_s=600) as c:
            ids = []
            for hist in histories:
                opened = c.call(OpenSession(rid=c.new_rid("o"), durable=True))
                assert isinstance(opened, SessionOpened) and opened.durable
                c.generate(Input(input_ids=hist), session=opened.session, max_tokens=32,
                           **SAMPLING)
                ids.append(opened.session)
            for sid, msg in zip(ids, messages, strict=True):
                fork = c.call(ForkSession(rid=c.new_rid("f"), session=sid))
                assert isinstance(fork, SessionsForked)
                s, n = timed_turn(c, msg, session=fork.sessions[0])
                rows["hot"].append(s)
                computed["hot"].append(n)
                c.call(CloseSession(rid=c.new_rid("c"), session=fork.sessions[0]))
            time.sleep(2.0)  # the last turns' blocks are written in the background
        disk = dir_bytes(state)
        with server(work / "two", state, args.threads, kv_tokens) as (endpoint, ready_s), \
                RawClient(endpoint, timeout_s=600) as c:
            # One unrelated request first, as any restarted server gets: the first forward
            # of a process pays one-time costs (allocator, thread pool) no turn should carry.
            timed_turn(c, messages[0][:8], namespace="warm-up")
            for sid, msg in zip(ids, messages, strict=True):
                back = c.call(ResumeSession(rid=c.new_rid("r"), session=sid))
                assert isinstance(back, SessionOpened)
                s, n = timed_turn(c, msg, session=sid)
                rows["restart"].append(s)
                computed["restart"].append(n)
            for i, (hist, msg) in enumerate(zip(histories, messages, strict=True)):
                # As long as that turn's prompt (a stand-in for the 32-token reply), under
                # a namespace of its own: nothing of it is cached.
                s, n = timed_turn(c, hist + list(range(100, 132)) + msg, namespace=f"cold{i}")
                rows["recompute"].append(s)
                computed["recompute"].append(n)
        peer = peer_restore(histories, messages, args.threads, work) if args.peer else []
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    lines = [
        "| next turn after ... | median time to first token | computed tokens (median) | vs hot |",
        "|---|---|---|---|",
    ]
    for name in ("hot", "restart", "recompute"):
        lines.append(f"| {name} | {med[name] * 1000:.0f} ms | {statistics.median(computed[name]):.0f} "
                     f"| {med[name] / med['hot']:.2f}x |")
    if peer:
        lines.append(f"| llama-server slot restore | {statistics.median(peer) * 1000:.0f} ms | - | "
                     f"{statistics.median(peer) / med['hot']:.2f}x |")
    lines += [
        "",
        f"- restart to ready: {ready_s:.2f} s with {args.sessions} durable sessions and "
        f"{disk / 2**20:.0f} MiB in the state directory (target < 5 s)",
        f"- restart vs hot: {med['restart'] / med['hot']:.2f}x (target <= 2x); recompute vs "
        f"restart: {med['recompute'] / med['restart']:.1f}x (target >= 10x)",
        f"- {args.sessions} sessions of {args.history:,} history tokens, a {args.message}-token "
        f"message, {args.threads} threads, {os.cpu_count()} CPUs; load average "
        f"{os.getloadavg()[0]:.1f}",
    ]
    text = "\n".join(lines)
    print("per session (ms):", {k: [round(x * 1000) for x in v] for k, v in rows.items()})
    print(text)
    if args.out:
        Path(args.out).write_text(f"Command: `{' '.join(['benchmarks/bench_durable.py', *sys.argv[1:]])}`\n\n"
                                  f"{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
