"""Frontend memory under bad input (issue 24): a real `radixlm serve --http` is sent bad
requests for --duration seconds from a few threads at once -- oversized and too many
headers, deep nesting, integers past 64 bits, bodies past the size limit, too many
messages, tools and parts, messages at the count bound (rendered, then refused as too
long), malformed JSON, bad parameters, and raw protocol junk on the ZeroMQ endpoint --
while the resident memory of the server's frontend and HTTP processes is sampled.

    .venv/bin/python benchmarks/soak_bad_input.py --duration 600
    .venv/bin/python benchmarks/soak_bad_input.py --model PATH --duration 60

Target: each process's RSS at the end within 50 MB of its RSS after the first pass
(the warm-up: code paths and allocator pools touched once). Results go to
benchmarks/results_soak.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from bench_frames import append_results  # (benchmarks/ is the script's own directory)

RESULTS = Path(__file__).with_name("results_soak.md")
KEY = "soak-key"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> dict[str, int]:
    """The server's processes by role: engine, frontend, http."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        if b"radixlm.runtime.http" in cmdline:
            found["http"] = int(entry.name)
        for role in ("engine", "frontend"):
            if b"radixlm.runtime.server.child" in cmdline and role.encode() in cmdline:
                found[role] = int(entry.name)
    return found


def raw(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            s.sendall(data)
            while s.recv(65536):
                pass
        except OSError:
            pass


def post(port: int, path: str, body: bytes, key: str | None = KEY) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"content-type": "application/json"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def bad_inputs(port: int, endpoint: str, model: str) -> list[tuple[str, Callable[[], object]]]:
    def chat(**fields: object) -> bytes:
        body: dict[str, object] = {"model": model, "max_tokens": 2,
                                   "messages": [{"role": "user", "content": "hi"}]}
        body.update(fields)
        return json.dumps(body).encode()

    msg = {"role": "user", "content": "x"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    part = {"type": "text", "text": "y"}
    deep = "[" * 50_000 + "]" * 50_000
    huge_messages = json.dumps({"model": model, "messages": [msg] * 100_000}).encode()

    def zmq_junk() -> None:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        for blob in (b"\x00" * 1000, b"\xde\xad" * 50_000, os.urandom(4096)):
            s.send(blob)
        time.sleep(0.05)
        s.close(0)
        ctx.term()

    return [
        ("100 MB header, no key", lambda: raw(port, b"GET /health HTTP/1.1\r\nx: "
                                              + b"a" * 100_000_000 + b"\r\n\r\n")),
        ("10,000 headers", lambda: raw(port, b"GET /health HTTP/1.1\r\n"
                                       + b"x-h: v\r\n" * 10_000 + b"\r\n")),
        ("deep nesting", lambda: post(port, "/v1/chat/completions",
                                      chat()[:-1] + b', "x": ' + deep.encode() + b"}")),
        ("max_tokens 2^70", lambda: post(port, "/v1/chat/completions", chat(max_tokens=2**70))),
        ("seed 2^64", lambda: post(port, "/v1/chat/completions", chat(seed=2**64))),
        ("100,000 messages", lambda: post(port, "/v1/chat/completions", huge_messages)),
        ("2,048 messages (at the bound)", lambda: post(port, "/v1/chat/completions",
                                                       chat(messages=[msg] * 2048))),
        ("1,000 tools", lambda: post(port, "/v1/chat/completions", chat(
            tools=[{**tool, "function": {**tool["function"], "name": f"f{i}"}}
                   for i in range(1000)]))),
        ("20,000 parts", lambda: post(port, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": [part] * 20_000}]))),
        ("body past the limit", lambda: post(port, "/v1/chat/completions",
                                             b'{"x": "' + b"z" * 6_000_000 + b'"}')),
        ("malformed JSON", lambda: post(port, "/v1/chat/completions", b"{not json" * 1000)),
        ("bad parameters", lambda: post(port, "/v1/chat/completions",
                                        chat(temperature="hot", n=0))),
        ("no key, big body", lambda: post(port, "/v1/chat/completions", huge_messages, key=None)),
        ("protocol junk", zmq_junk),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of bad input")
    ap.add_argument("--threads", type=int, default=3, help="clients sending at once")
    ap.add_argument("--sample-every", type=float, default=10.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="radixlm-soak-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint_file = work / "endpoint"
    log = (work / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--model", args.model,
         "--device", "cpu", "--threads", "1", "--kv-tokens", "8192", "--endpoint-file",
         str(endpoint_file), "--http", f"127.0.0.1:{port}", "--api-key", KEY],
        stdout=log, stderr=log, start_new_session=True)
    try:
        while not endpoint_file.exists():
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {(work / 'server.log').read_text()}")
            time.sleep(0.2)
        endpoint = endpoint_file.read_text().strip()
        while post(port, "/v1/models", b"") not in (200, 405):
            time.sleep(0.2)
        roles = children(proc.pid)
        cases = bad_inputs(port, endpoint, args.model)
        for _, send in cases:  # the warm-up pass
            send()
        start = {r: rss_mb(p) for r, p in roles.items() if r != "engine"}
        peak = dict(start)
        sent = 0
        stop_at = time.monotonic() + args.duration
        lock = threading.Lock()

        def client(offset: int) -> None:
            nonlocal sent
            i = offset
            while time.monotonic() < stop_at:
                cases[i % len(cases)][1]()
                i += 1
                with lock:
                    sent += 1

        threads = [threading.Thread(target=client, args=(k * 5,)) for k in range(args.threads)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(args.sample_every, max(0.1, stop_at - time.monotonic())))
            for r in start:
                peak[r] = max(peak[r], rss_mb(roles[r]))
            print(f"  {time.monotonic() - stop_at + args.duration:6.0f} s: {sent} requests; "
                  + ", ".join(f"{r} {rss_mb(roles[r]):.0f} MB" for r in start), flush=True)
        for t in threads:
            t.join()
        time.sleep(2)
        end = {r: rss_mb(p) for r, p in roles.items() if r in start}
        alive = proc.poll() is None and post(port, "/v1/chat/completions", json.dumps({
            "model": args.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}).encode()) == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    rows = ["| process | RSS after warm-up (MB) | peak (MB) | end (MB) | growth (MB) | target |",
            "|---|---|---|---|---|---|"]
    for r in start:
        growth = end[r] - start[r]
        rows.append(f"| {r} | {start[r]:.0f} | {peak[r]:.0f} | {end[r]:.0f} | {growth:+.1f} | "
                    f"<= 50: {'met' if growth <= 50 else 'NOT met'} |")
    rows.append(f"| (requests sent: {sent} over {args.duration:.0f} s by {args.threads} "
                f"clients; {len(cases)} kinds; server serving after: {alive}) | | | | | |")
    table = "\n".join(rows)
    print(table)
    command = (f"  .venv/bin/python benchmarks/soak_bad_input.py --model {args.model} "
               f"--duration {args.duration:g} --threads {args.threads}")
    append_results(RESULTS, "Bad-input soak", args.model, command, table)


if __name__ == "__main__":
    main()
