#!/usr/bin/env python3
"""Agents under memory pressure: tool-aware retention and program scheduling against
today's policy, and llama-server with one pinned slot per agent (the anchor, opt-in).

Trace (seeded: `--seed`), SmolLM2-135M-Instruct on CPU, greedy:
  - `--agents` agents (32) x `--turns` turns (8). Every agent has its own session (soft
    retention: the engine may demote it under pressure) and its own task; the first turn
    sends the system prompt and the task, every later one the previous tool's output as a
    `tool` message. Every turn carries 4 tools and names the one it calls (tool_choice,
    constrained decoding: a short JSON call), so every turn ends in a tool call, which the
    engine reads from the output as it does for any request with tools.
  - Tool outputs: uniform in [100, 1,500] tokens (words), x `--token-scale`.
  - Tool durations: heavy-tailed. Each tool's round trips are lognormal with sigma 0.9
    around its own median -- read_file 0.7 s, search 1.4 s, shell 2.8 s, run_tests 5.6 s
    -- so that, over the trace's equally likely tools, they are about lognormal with a
    median of 2 s and a 99th percentile of ~31 s (`mixture_quantiles` prints them); all x
    `--time-scale` (this 2-core machine: 0.25 by default, said in the report).
  - Agents start 0.05 s apart; an agent's completion time runs from its start to the end
    of its last turn (the last tool's output is not appended).

Each radixlm run drives one engine in this process (the scheduler loop, no sockets: the
frontend's own preparation renders and tokenizes every input, so the engine gets what
`radixlm serve` would give it), KV pool at 40% of the trace's working set (`--pool-share`;
the working set is the agents' final histories), host tier of the whole working set
(`--host-share`, 1.0; below 1 the host tier overflows and its evictions spill to disk; 0:
no host tier) and a disk tier in a temporary state directory ("while host and disk have
room"). Rows:
  today          the engine without tool awareness: idle soft sessions demoted least
                 recently used first, nothing brought back before the result comes; the
                 default schedule policy (lpm);
  + tool-aware   tool-aware retention: overdue waits demoted first, then the ones expected
                 back last; demoted waits prefetched as their estimates say the result
                 is near, and at the append;
  + program      the same with `--schedule-policy program` (discretised attained service,
                 first come first served by program within a level; on CPU one program's
                 prompt a step, its slices waiting for the decodes of programs above it);
  llama-server   (`--peer`) one slot per agent (`id_slot`, `cache_prompt`), context enough
                 for every history: each agent's turns are sent as the whole token history
                 (its own replies, n_predict = radixlm's reply lengths), with the same tool
                 durations, one thread per agent.

Reported: mean and p99 agent completion time, tokens recomputed (history tokens computed
again because they had been evicted, `usage.recomputed_tokens`) against the trace's
history tokens (each turn's history before its append), prompt tokens computed, restored
from the tiers, and the prefetch hit rate (of the results appended to a session demoted
during its wait, the share that found its history back in the pool). Targets: mean agent
completion >= 1.5x lower than today's; recomputed < 5% of history tokens (tool-aware).

    .venv/bin/python benchmarks/bench_agents.py [--quick] [--peer] [--out FILE]
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = {"read_file": 0.7, "search": 1.4, "shell": 2.8, "run_tests": 5.6}  # median seconds
TOOL_SIGMA = 0.9
WORDS = ["cache", "prefix", "token", "session", "branch", "agent", "tool", "result", "reply", "model", "layer", "weight", "engine", "request", "batch", "decode", "prefill", "radix", "tree", "node", "slot", "page", "memory", "thread", "kernel", "block", "file", "path", "error", "status", "value", "config", "user", "index", "query", "table", "column", "schema", "function", "class", "method", "module", "package", "import", "export", "return", "retry", "header", "payload", "json", "field", "array", "object", "string", "number", "commit", "merge", "diff", "patch", "line", "offset"]
CLIENT = b"bench-agents"


# --------------------------------------------------------------------------- the trace
@dataclass(frozen=True)
class Turn:
    tool: str  # the tool this turn calls
    output: str  # that tool's output (appended by the next turn)
    duration: float  # its round trip, seconds (scaled)


@dataclass(frozen=True)
class AgentTrace:
    task: str
    turns: list[Turn]
    start: float  # seconds after the run's start


def words_of(rng: random.Random, tok, n_tokens: int) -> str:
    """Text of about `n_tokens` tokens (whole words)."""
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    ids = tok.encode(text)[:n_tokens]
    return tok.decode(ids)


def make_trace(args, tok) -> list[AgentTrace]:
    rng = random.Random(args.seed)
    lo, hi = (max(1, round(x * args.token_scale)) for x in (100, 1500))
    agents = []
    for a in range(args.agents):
        turns = []
        for _ in range(args.turns):
            tool = rng.choice(list(TOOLS))
            duration = math.exp(rng.gauss(math.log(TOOLS[tool]), TOOL_SIGMA)) * args.time_scale
            turns.append(Turn(tool, f"[{tool} #{a}] " + words_of(rng, tok, rng.randint(lo, hi)),
                              duration))
        task = f"Agent {a}: fix the failing test in module {rng.choice(WORDS)}. " + \
            words_of(rng, tok, 40)
        agents.append(AgentTrace(task, turns, 0.05 * a))
    return agents


def mixture_quantiles(n: int = 200_000) -> tuple[float, float]:
    """(median, p99) of the unscaled durations over equally likely tools (sampled)."""
    rng = random.Random(0)
    xs = sorted(math.exp(rng.gauss(math.log(rng.choice(list(TOOLS.values()))), TOOL_SIGMA))
                for _ in range(n))
    return xs[n // 2], xs[int(n * 0.99)]


SYSTEM = "You are a coding agent. Work step by step and call one tool per reply."


def tool_defs():
    from radixlm.runtime.protocol import Tool

    schema = {"type": "object", "properties": {"arg": {"type": "string", "maxLength": 16}},
              "required": ["arg"], "additionalProperties": False}
    return [Tool(name=name, description=f"{name} in the repository", parameters=schema)
            for name in TOOLS]


# ------------------------------------------------------------------------ radixlm run
@dataclass
class RunResult:
    name: str
    completion: list[float]  # per agent, seconds
    history_tokens: int = 0  # each turn's history before its append, summed
    recomputed: int = 0
    restored: int = 0
    computed: int = 0  # prompt tokens run through the model
    prompt: int = 0
    hits: int = 0
    misses: int = 0
    wall: float = 0.0
    forward: float = 0.0  # seconds in model forwards
    steps: int = 0
    replies: dict[tuple[int, int], int] = field(default_factory=dict)  # reply lengths

    @property
    def mean(self) -> float:
        return statistics.fmean(self.completion)

    @property
    def p99(self) -> float:
        xs = sorted(self.completion)
        return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None


class InProcess:
    """One engine built as `radixlm serve` builds it, driven without sockets; inputs
    prepared by the frontend's own functions."""

    def __init__(self, args, pool: int, host: int, state_dir: str, policy: str,
                 tool_aware: bool) -> None:
        from radixlm.runtime.config import EngineConfig
        from radixlm.runtime.engine.engine_main import build_engine
        from radixlm.runtime.frontend.prepare import TextModel
        from radixlm.tokenizer import Tokenizer

        config = EngineConfig(model=args.model, device="cpu", kv_tokens=pool,
                              host_kv_tokens=host, state_dir=state_dir, threads=args.threads,
                              schedule_policy=policy)
        self.engine = build_engine(config)
        self.sched = self.engine.scheduler
        manager = self.sched.sessions.manager
        assert manager is not None
        manager.tools.enabled = tool_aware
        ready = self.engine.ready
        self.text = TextModel.load(Tokenizer.load(ready.model_dir), ready.context_length,
                                   ready.vocab_size)
        self.keys = iter(range(1, 1 << 62))
        self.replies: dict[str, object] = {}
        self.on_final: dict[int, Callable[[list[int], object], None]] = {}
        self.outputs: dict[int, list[int]] = {}

    def call(self, msg, rid: str):
        self.sched.handle(msg)
        self._collect()
        while rid not in self.replies:
            self.step()
        return self.replies.pop(rid)

    def submit(self, sid: str, messages, tool: str,
               done: Callable[[list[int], object], None]) -> int:
        from radixlm.runtime.engine.wire import EngineGenerate
        from radixlm.runtime.frontend.prepare import assistant_flag, generate_ids
        from radixlm.runtime.frontend.structured import plan_structured
        from radixlm.runtime.protocol import Generate, Input, NamedToolChoice, SamplingParams

        msg = Generate(rid="g", input=Input(messages=messages), session=sid,
                       sampling=SamplingParams(max_tokens=48, temperature=0.0),
                       tools=tool_defs(), tool_choice=NamedToolChoice(name=tool))
        plan = plan_structured(msg, self.text.tool_format)
        ids, variants = generate_ids(self.text, msg)
        key = next(self.keys)
        self.outputs[key] = []
        self.on_final[key] = done
        self.sched.handle(EngineGenerate(
            key=key, client=CLIENT, rid=f"g{key}", input_ids=ids, sampling=msg.sampling,
            session=sid, grammar=plan.grammar, assistant_open=assistant_flag(msg.input),
            variants=variants, tools=[t.name for t in plan.tools or ()],
            arrived=time.monotonic()))
        self._collect()
        return key

    def step(self) -> bool:
        self.sched.maybe_tick()
        ran = self.sched.step() if self.sched.has_work() else False
        self._collect()
        return ran

    def _collect(self) -> None:
        from radixlm.runtime.engine.wire import StepOutputs, ToClient
        from radixlm.runtime.protocol import Error, decode_server

        for out in self.sched.take_outbox():
            if isinstance(out, ToClient):
                reply = decode_server(out.data)
                if isinstance(reply, Error):
                    raise RuntimeError(f"{reply.rid}: {reply.code}: {reply.message}")
                self.replies[reply.rid] = reply
            elif isinstance(out, StepOutputs):
                for o in out.outputs:
                    self.outputs[o.key] += o.token_ids
                    if o.finish_reason is not None:
                        self.on_final.pop(o.key)(self.outputs.pop(o.key), o)

    def stats(self):
        from radixlm.runtime.engine.wire import EngineCommand
        from radixlm.runtime.protocol import GetStats

        return self.call(EngineCommand(client=CLIENT, msg=GetStats(rid="stats")), "stats")

    def close(self) -> None:
        self.sched.check_integrity()
        self.engine.close()


def run_radix(args, trace: list[AgentTrace], name: str, pool: int, host: int, policy: str,
              tool_aware: bool) -> RunResult:
    from radixlm.runtime.engine.wire import EngineOpenSession
    from radixlm.runtime.protocol import Message

    with tempfile.TemporaryDirectory(prefix="bench-agents-") as state:
        eng = InProcess(args, pool, host, state, policy, tool_aware)
        res = RunResult(name, [0.0] * len(trace))
        sids = []
        for a in range(len(trace)):
            opened = eng.call(EngineOpenSession(client=CLIENT, rid=f"o{a}", input_ids=[],
                                                retention="soft"), f"o{a}")
            sids.append(opened.session)
        c0 = eng.sched.counters
        before = (c0.prompt_tokens, c0.computed_tokens)
        ready: list[tuple[float, int, int]] = []  # (when, agent, turn)
        t0 = time.monotonic()
        for a, ag in enumerate(trace):
            heapq.heappush(ready, (t0 + ag.start, a, 0))
        left = len(trace)

        def finished(a: int, t: int, appended: int) -> Callable[[list[int], object], None]:
            def done(ids: list[int], out) -> None:
                nonlocal left
                now = time.monotonic()
                u = out.usage
                res.history_tokens += u.prompt_tokens - appended
                res.recomputed += u.recomputed_tokens
                res.restored += u.restored_tokens
                res.replies[(a, t)] = len(ids)
                if t + 1 == len(trace[a].turns):
                    res.completion[a] = now - (t0 + trace[a].start)
                    left -= 1
                else:
                    heapq.heappush(ready, (now + trace[a].turns[t].duration, a, t + 1))
            return done

        shown = time.monotonic()
        while left:
            now = time.monotonic()
            if now - shown >= 60:  # progress, for long runs
                shown = now
                print(f"    {name}: {len(res.replies)} of {len(trace) * len(trace[0].turns)} "
                      f"turns done after {now - t0:.0f}s", file=sys.stderr, flush=True)
            while ready and ready[0][0] <= now:
                _, a, t = heapq.heappop(ready)
                ag = trace[a]
                if t == 0:
                    msgs = [Message(role="system", content=SYSTEM),
                            Message(role="user", content=ag.task)]
                else:
                    prev = ag.turns[t - 1]
                    msgs = [Message(role="tool", content=prev.output, name=prev.tool)]
                history = eng.sched.sessions.manager.records.sessions[sids[a]].length
                eng.submit(sids[a], msgs, ag.turns[t].tool,
                           _with_history(finished, a, t, history))
            if not eng.step():
                wait = (ready[0][0] - time.monotonic()) if ready else 0.01
                time.sleep(min(max(wait, 0.0), 0.01))
        res.wall = time.monotonic() - t0
        c = eng.sched.counters
        res.prompt, res.computed = c.prompt_tokens - before[0], c.computed_tokens - before[1]
        res.forward, res.steps = c.forward_s, c.steps
        p = eng.stats().prefetch
        res.hits, res.misses = p.get("hits", 0), p.get("misses", 0)
        eng.close()
    return res


def _with_history(finished, a: int, t: int, history: int):
    """The turn's final-output handler, told the history length it appended to."""

    def done(ids: list[int], out) -> None:
        appended = out.usage.prompt_tokens - history
        finished(a, t, appended)(ids, out)

    return done


# ------------------------------------------------------------------- llama-server run
def run_llama(args, trace: list[AgentTrace], replies: dict[tuple[int, int], int],
              ctx_per_slot: int) -> RunResult:
    """Each agent on its own slot, in its own thread, sending its whole token history."""
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(HERE))
    import bench_peer as bp
    from radixlm.runtime.model import resolve_model
    from radixlm.runtime.model.resolve import default_gguf_path
    from radixlm.tokenizer.tools import generic_tool_prompt
    from transformers import AutoTokenizer

    binary = bp.ensure_llama_server(bp.peer_dir(), 2)
    gguf = default_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(resolve_model(str(gguf))))
    srv = bp.LlamaServer(binary, gguf, args.threads, len(trace), ctx_per_slot)
    res = RunResult("llama-server (slot per agent)", [0.0] * len(trace))
    computed = [0] * len(trace)
    history = [0] * len(trace)
    t0 = time.monotonic()

    def agent(a: int) -> None:
        ag = trace[a]
        time.sleep(ag.start)
        # The conversation radixlm's frontend renders: the tools shown in the system message
        # (SmolLM2's template knows no tools), then the task.
        system = f"{SYSTEM}\n\n{generic_tool_prompt(tool_defs())}"
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": ag.task}]
        ids = hf.encode(hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
        before = 0  # the history each turn's input is appended to
        for t, turn in enumerate(ag.turns):
            history[a] += before
            r = srv.complete(ids, replies.get((a, t), 24), slot=a)
            computed[a] += r["prompt_n"]
            ids = ids + r["ids"]
            before = len(ids)
            if t + 1 < len(ag.turns):
                time.sleep(turn.duration)
                tail = hf.apply_chat_template(
                    [{"role": "tool", "content": turn.output}], tokenize=False,
                    add_generation_prompt=True)
                ids = ids + hf.encode("<|im_end|>\n" + tail, add_special_tokens=False)
        res.completion[a] = time.monotonic() - (t0 + ag.start)

    try:
        with ThreadPoolExecutor(len(trace)) as ex:
            list(ex.map(agent, range(len(trace))))
    finally:
        srv.close()
    res.wall = time.monotonic() - t0
    res.computed = sum(computed)
    res.history_tokens = sum(history)
    return res


# ------------------------------------------------------------------------------ report
def table(rows: list[RunResult], base: RunResult | None) -> list[str]:
    out = ["| run | mean agent completion (s) | p99 (s) | mean vs today | recomputed / history "
           "tokens | restored | prompt tokens computed | prefetch hit rate | wall (s) |",
           "|" + "---|" * 9]
    for r in rows:
        vs = f"{base.mean / r.mean:.2f}x" if base is not None else "-"
        share = f"{r.recomputed:,} / {r.history_tokens:,} ({r.recomputed / r.history_tokens:.1%})" \
            if r.history_tokens else "-"
        hit = f"{r.hit_rate:.0%} ({r.hits}/{r.hits + r.misses})" if r.hit_rate is not None else "-"
        out.append(f"| {r.name} | {r.mean:.1f} | {r.p99:.1f} | {vs} | {share} | {r.restored:,} "
                   f"| {r.computed:,} | {hit} | {r.wall:.0f} |")
    return out


def targets(rows: list[RunResult]) -> list[str]:
    by = {r.name: r for r in rows}
    today, aware, prog = by.get("today"), by.get("+ tool-aware"), by.get("+ program")
    out = []
    if today and (aware or prog):
        best = min((r for r in (aware, prog) if r), key=lambda r: r.mean)
        ok = today.mean / best.mean >= 1.5
        out.append(f"- mean agent completion >= 1.5x lower than today's: {today.mean / best.mean:.2f}x "
                   f"({best.name}): {'met' if ok else 'NOT met'}")
    if aware and aware.history_tokens:
        share = aware.recomputed / aware.history_tokens
        out.append(f"- recomputed < 5% of history tokens (tool-aware): {share:.1%}: "
                   f"{'met' if share < 0.05 else 'NOT met'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--token-scale", type=float, default=1.0, help="x the tool output tokens")
    ap.add_argument("--time-scale", type=float, default=0.25, help="x the tool durations")
    ap.add_argument("--pool-share", type=float, default=0.4, help="KV pool / working set")
    ap.add_argument("--host-share", type=float, default=1.0, help="host KV tier / working set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--rows", default="today,tool-aware,program",
                    help="radixlm rows: today, tool-aware, program")
    ap.add_argument("--peer", action="store_true", help="also llama-server, a slot per agent")
    ap.add_argument("--quick", action="store_true", help="4 agents x 3 turns, 0.1x tokens")
    ap.add_argument("--out", default="", help="write the report (markdown) here")
    args = ap.parse_args(argv)
    if args.host_share < 0:
        ap.error("--host-share must be >= 0")
    if args.quick:
        args.agents, args.turns, args.token_scale = 4, 3, 0.1
    import torch
    from radixlm.runtime.model import resolve_model
    from radixlm.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    tok = Tokenizer.load(resolve_model(args.model))
    trace = make_trace(args, tok)
    median, p99 = mixture_quantiles()
    # The working set: every agent's final history (system + task + outputs + ~24-token calls).
    working = sum(len(tok.encode(SYSTEM + ag.task)) + 200 + sum(
        len(tok.encode(t.output)) + 40 for t in ag.turns) for ag in trace)
    longest = max(len(tok.encode(SYSTEM + ag.task)) + 300 + sum(
        len(tok.encode(t.output)) + 80 for t in ag.turns) for ag in trace)
    # (at least twice the longest history: a turn must fit beside the others running)
    pool = max(int(working * args.pool_share), 2 * longest)
    host = int(working * args.host_share)
    load0 = os.getloadavg()[0]
    print(f"trace: {args.agents} agents x {args.turns} turns, working set ~{working:,} tokens, "
          f"pool {pool:,}, host tier {host:,}; tool durations x{args.time_scale} "
          f"(unscaled median {median:.1f}s, p99 {p99:.1f}s)", flush=True)
    configs = {"today": ("today", "lpm", False), "tool-aware": ("+ tool-aware", "lpm", True),
               "program": ("+ program", "program", True)}
    rows: list[RunResult] = []
    for key in args.rows.split(","):
        name, policy, aware = configs[key]
        r = run_radix(args, trace, name, pool, host, policy, aware)
        rows.append(r)
        print(f"  {r.name}: mean {r.mean:.1f}s p99 {r.p99:.1f}s, recomputed {r.recomputed:,}, "
              f"hits {r.hits}/{r.hits + r.misses}, wall {r.wall:.0f}s (forward {r.forward:.0f}s, "
              f"{r.steps} steps, {r.computed:,} prompt tokens computed)", flush=True)
    if args.peer:
        rows.append(run_llama(args, trace, rows[0].replies if rows else {}, longest))
    base = next((r for r in rows if r.name == "today"), None)
    lines = [f"# Agents benchmark (`bench_agents.py {' '.join(argv or sys.argv[1:])}`)", "",
             f"{args.agents} agents x {args.turns} turns; tool outputs "
             f"{max(1, round(100 * args.token_scale))}-{max(1, round(1500 * args.token_scale))} "
             f"tokens; tool durations lognormal per tool (medians "
             f"{', '.join(f'{k} {v}s' for k, v in TOOLS.items())}, sigma {TOOL_SIGMA}: over the "
             f"trace median {median:.1f}s, p99 {p99:.0f}s) x {args.time_scale}; working set "
             f"~{working:,} tokens, KV pool {pool:,} ({args.pool_share:.0%}), host tier "
             f"{host:,} ({args.host_share:.0%}), disk tier on; {args.threads} threads; load "
             f"average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs).", "",
             *table(rows, base), "", *targets(rows)]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
