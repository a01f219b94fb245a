"""The router (runtime/router) on an agent workload: prompt tokens computed with
cache-aware routing against round-robin and against one engine, the load balance
between replicas, the same run with one replica SIGKILLed half-way, and what one
routing decision costs with 10,000 live sessions over 64 replicas.

Workload: 64 agents x 6 turns on one shared tool prompt (a system message of about
1,000 characters), greedy, 16-token replies (ignore_eos). Each agent runs its turns one
after another, all agents at once. Two ways to be an agent:
  resend    the OpenAI way: every turn is a plain generate of the whole conversation
            (system, then each user message and assistant reply): the router must send
            an agent's turns where its conversation is cached.
  sessions  each agent opens a session from the pinned tool prompt and appends each
            turn's message (the router sends turns home by id; placement is the pin's
            and the opening's).
Engines: the tiny random Llama of tests/tiny_models.py (4,096-token context), or --model.
Replicas are ordinary `radixlm serve` processes (started here with the launcher); the
router is `radixlm router` in its own process.

Computed prompt tokens = sum over requests of (prompt_tokens - cached_tokens), from the
replies' usage (recomputed session histories included: the router reports them there).
Imbalance = the busiest replica's computed tokens / the mean over replicas.

    .venv/bin/python benchmarks/bench_router.py [--agents 64] [--turns 6] [--out FILE]
        [--cases one,cache,rr,...] [--no-cost]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Done,
    Error,
    Generate,
    GetStats,
    Hello,
    Input,
    Message,
    OpenSession,
    Pin,
    SamplingParams,
    SessionOpened,
    StatsReply,
    decode_server,
    encode,
)
from radixlm.runtime.server.launcher import RunningServer, connect_address, start_server

REPLY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
WORDS = ["grep", "search", "file", "read", "write", "list", "tool", "call", "result", "error", "ok", "path", "line", "match", "value", "config", "build", "test", "deploy", "status", "commit", "branch", "merge"]


def tool_prompt(rng: random.Random) -> str:
    tools = [f"- {w}_{i}(arg: string): {' '.join(rng.choice(WORDS) for _ in range(8))}"
             for i, w in enumerate(WORDS[:16])]
    return "You are an agent. Tools:\n" + "\n".join(tools)


def tool_result(rng: random.Random, agent: int, turn: int) -> str:
    return f"[agent {agent} turn {turn}] " + " ".join(rng.choice(WORDS) for _ in range(16))


@dataclass
class Tally:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    prompt: int = 0
    computed: int = 0
    recomputed: int = 0
    done_agents: int = 0

    def add(self, done: Done) -> None:
        self.requests += 1
        self.prompt += done.usage.prompt_tokens
        self.computed += done.usage.prompt_tokens - done.usage.cached_tokens
        self.recomputed += done.usage.recomputed_tokens


class Conn:
    """One agent's DEALER: one request at a time."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.n = 0

    async def call(self, msg: Any) -> Any:
        self.n += 1
        msg = msgspec.structs.replace(msg, rid=f"r{self.n}")
        await self.sock.send(encode(msg))
        while True:
            reply = decode_server(await self.sock.recv())
            if getattr(reply, "rid", None) in (f"r{self.n}", None) or isinstance(reply, Error):
                return reply

    async def hello(self) -> None:
        await self.sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION, client_name="bench")))
        decode_server(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


async def agent(conn: Conn, mode: str, index: int, turns: int, system: str, tally: Tally,
                progress: asyncio.Event, half: int) -> None:
    rng = random.Random(1000 + index)
    await conn.hello()
    history: list[Message] = [Message(role="system", content=system)]
    session = None
    if mode == "sessions":
        opened = await conn.call(OpenSession(rid="", pinned="tools"))
        if not isinstance(opened, SessionOpened):
            tally.errors.append(f"agent {index}: open: {opened}")
            return
        session = opened.session
    for turn in range(turns):
        user = Message(role="user", content=tool_result(rng, index, turn))
        if mode == "sessions":
            inp = Input(messages=[user])
        else:
            history.append(user)
            inp = Input(messages=list(history))
        done = await conn.call(Generate(rid="", input=inp, session=session, sampling=REPLY))
        if not isinstance(done, Done):
            tally.errors.append(f"agent {index} turn {turn}: {done}")
            return
        tally.add(done)
        if tally.requests >= half:
            progress.set()
        history.append(Message(role="assistant", content=done.text))
    tally.done_agents += 1


def kill(server: RunningServer) -> None:
    for proc in server.processes.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    for proc in server.processes.values():
        proc.wait()


async def drive(endpoint: str, mode: str, agents: int, turns: int, system: str,
                victim: RunningServer | None) -> tuple[Tally, float]:
    ctx = zmq.asyncio.Context()
    tally = Tally()
    progress = asyncio.Event()
    conns = [Conn(ctx, endpoint) for _ in range(agents)]
    if mode == "sessions":
        pinner = Conn(ctx, endpoint)
        await pinner.hello()
        pinned = await pinner.call(Pin(rid="", name="tools", input=Input(
            messages=[Message(role="system", content=system)], add_generation_prompt=False)))
        assert not isinstance(pinned, Error), pinned
    start = time.perf_counter()
    tasks = [asyncio.ensure_future(agent(c, mode, i, turns, system, tally, progress,
                                         agents * turns // 2)) for i, c in enumerate(conns)]
    if victim is not None:
        await progress.wait()
        kill(victim)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    if mode == "sessions":
        pinner.close()
    ctx.destroy(0)
    return tally, elapsed


def replica_computed(servers: list[RunningServer]) -> list[int]:
    out = []
    ctx = zmq.Context()
    for s in servers:
        if any(p.poll() is not None for p in s.processes.values()):
            out.append(-1)
            continue
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(connect_address(s.endpoint))
        sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
        sock.recv()
        sock.send(encode(GetStats(rid="s")))
        stats = decode_server(sock.recv())
        assert isinstance(stats, StatsReply)
        out.append(stats.prompt_tokens_total - stats.cached_tokens_total)
        sock.close(0)
    ctx.term()
    return out


@contextlib.contextmanager
def router_process(replicas: list[RunningServer], policy: str, workdir: Path):
    endpoint_file = workdir / f"router-{policy}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "radixlm.runtime.cli", "router", "--endpoint-file",
               str(endpoint_file), "--routing-policy", policy, "--replica-timeout", "3",
               "--log-level", "warning"]
    for s in replicas:
        command += ["--replica", connect_address(s.endpoint)]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while not endpoint_file.exists():
            assert proc.poll() is None, "router exited"
            time.sleep(0.05)
        time.sleep(1.0)  # every replica's welcome
        yield endpoint_file.read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()  # (it stays a failure: the router must stop on SIGTERM)
            raise


def run_case(name: str, engine: EngineConfig, replicas: int, policy: str | None, mode: str,
             args: argparse.Namespace, system: str, workdir: Path, kill_half: bool = False) -> dict[str, Any]:
    servers = [start_server(engine, start_timeout_s=300) for _ in range(replicas)]
    try:
        if policy is None:
            tally, elapsed = asyncio.run(drive(connect_address(servers[0].endpoint), mode,
                                               args.agents, args.turns, system, None))
        else:
            with router_process(servers, policy, workdir) as endpoint:
                tally, elapsed = asyncio.run(drive(endpoint, mode, args.agents, args.turns,
                                                   system, servers[1] if kill_half else None))
        per_replica = replica_computed(servers)
    finally:
        for s in servers:
            s.stop()
    alive = [c for c in per_replica if c >= 0]
    row = dict(name=name, mode=mode, requests=tally.requests, agents_done=tally.done_agents,
               errors=len(tally.errors), prompt=tally.prompt, computed=tally.computed,
               recomputed=tally.recomputed, per_replica=per_replica,
               imbalance=(max(alive) / statistics.mean(alive)) if len(alive) > 1 and
               statistics.mean(alive) else 1.0, seconds=elapsed)
    if tally.errors:
        print(f"  {name}: {tally.errors[:3]}", file=sys.stderr)
    print(f"  {row}", file=sys.stderr, flush=True)
    return row


def routing_cost(sessions: int = 10_000, replicas: int = 64, trials: int = 20_000) -> dict[str, float]:
    """Per-request decision time of the router's own dispatch (decode, route, record),
    with `sessions` live sessions over `replicas` simulated replicas (sends are no-ops)."""
    from radixlm.runtime.router.config import ReplicaSpec, RouterConfig
    from radixlm.runtime.router.main import tune_gc
    from radixlm.runtime.router.records import Opened, SessionRecord
    from radixlm.runtime.router.server import Client, Router

    tune_gc()  # as the router process does (its collections are part of its cost)
    ctx: zmq.Context[Any] = zmq.Context()
    front, monitor = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PAIR)
    config = RouterConfig(replicas=tuple(ReplicaSpec(f"ipc:///sim/{i}") for i in range(replicas)))
    router = Router(config, ctx, front, monitor, None)
    router.welcome = object()  # type: ignore[assignment]
    for r in router.replicas.replicas:
        r.up = True
    router.send = lambda client, replica, msg: None  # type: ignore[method-assign]
    client = Client(b"bench", -1, None, welcomed=True)
    router.clients[client.ident] = client
    rng = random.Random(0)
    system = tool_prompt(rng)
    opened = OpenSession(rid="o")
    for i in range(sessions):
        key = f"\x00\x00\x1esystem\x1f{system}\x1euser\x1fagent {i} " + " ".join(
            rng.choice(WORDS) for _ in range(30))
        vid = f"{i:032x}"
        router.sessions.records[vid] = SessionRecord(vid, client.ident, None, i % replicas, vid,
                                                     500, key, [Opened(opened)])
        router.routing.tree.insert(key, i % replicas)
    turn = [encode(Generate(rid=f"t{i}", session=f"{rng.randrange(sessions):032x}",
                            input=Input(messages=[Message(role="user", content="next result")]),
                            sampling=REPLY)) for i in range(trials)]
    new = [encode(Generate(rid=f"n{i}", input=Input(messages=[
        Message(role="system", content=system),
        Message(role="user", content=f"agent {rng.randrange(sessions)} " + " ".join(
            rng.choice(WORDS) for _ in range(30)))]), sampling=REPLY)) for i in range(trials)]
    out = {}
    for name, frames in (("session turn", turn), ("new request", new)):
        # CPU time of this process: on a shared machine, wall time would count the
        # other processes' turns on the cores too
        start = time.process_time()
        for data in frames:
            router.dispatch(client, data)
        out[name] = (time.process_time() - start) / len(frames) * 1e6
        client.pending.clear()
        router.routing.loads = [0] * replicas
    front.close(0)
    monitor.close(0)
    ctx.term()
    return out


# name on the command line: (row name, replicas, policy (None: one engine), mode, kill)
CASES: dict[str, tuple[str, int, str | None, str, bool]] = {
    "one": ("one engine", 1, None, "resend", False),
    "cache": ("cache-aware, 2 replicas", 2, "cache_aware", "resend", False),
    "rr": ("round-robin, 2 replicas", 2, "round_robin", "resend", False),
    "kill": ("cache-aware, replica 2 killed half-way", 2, "cache_aware", "resend", True),
    "s-one": ("one engine", 1, None, "sessions", False),
    "s-cache": ("cache-aware, 2 replicas", 2, "cache_aware", "sessions", False),
    "s-kill": ("cache-aware, replica 2 killed half-way", 2, "cache_aware", "sessions", True),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--model", default=None, help="default: the tiny random Llama")
    p.add_argument("--kv-tokens", type=int, default=200_000)
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default="all", help="a quicker run: comma-separated of "
                   f"{','.join(CASES)} (the one-engine baseline of a mode runs with it)")
    p.add_argument("--no-cost", action="store_true", help="skip the routing-cost row")
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import make_tiny_checkpoint

        model = str(make_tiny_checkpoint(workdir / "model", "llama", max_position_embeddings=4096))
    engine = EngineConfig(model=model, device="cpu", dtype="float32", kv_tokens=args.kv_tokens,
                          threads=1)
    system = tool_prompt(random.Random(7))
    cost = {} if args.no_cost else routing_cost()
    print(f"routing cost: {cost}", file=sys.stderr, flush=True)
    wanted = set(CASES) if args.cases == "all" else set(args.cases.split(","))
    if wanted - set(CASES):
        p.error(f"unknown cases: {sorted(wanted - set(CASES))}")
    modes = {CASES[c][3] for c in wanted}
    rows = [run_case(name, engine, replicas, policy, mode, args, system, workdir,
                     kill_half=kill)
            for case, (name, replicas, policy, mode, kill) in CASES.items()
            if case in wanted or (policy is None and mode in modes)]
    lines = [f"{args.agents} agents x {args.turns} turns, one shared tool prompt "
             f"({len(system)} chars), greedy 16-token replies; model: "
             f"{'tiny random Llama' if args.model is None else args.model}", "",
             "| mode | run | requests ok | agents done | prompt tokens | computed | vs one engine "
             "| recomputed | per replica (computed) | imbalance | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["mode"]: r["computed"] for r in rows if r["name"] == "one engine"}
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['name']} | {r['requests']} | {r['agents_done']}/{args.agents} "
            f"| {r['prompt']:,} | {r['computed']:,} | {r['computed'] / base[r['mode']] - 1:+.1%} "
            f"| {r['recomputed']:,} | {', '.join('dead' if c < 0 else f'{c:,}' for c in r['per_replica'])} "
            f"| {r['imbalance']:.2f} | {r['seconds']:.1f} |")
    if cost:
        lines += ["", "| routing decision (10,000 live sessions, 64 simulated replicas) "
                  "| µs per request |", "|---|---|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in cost.items()]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
