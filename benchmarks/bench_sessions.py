"""Persistent sessions on an agent workload, against re-sending the conversation and
against no prefix cache.

Workload (SmolLM2-135M-Instruct, greedy, ignore_eos): 8 agents x 6 turns on one pinned
1,500-token tool prompt; each turn appends a tool result of 100-300 tokens and gets a
32-token reply. After its 3rd turn, each of 2 agents forks 3 sub-agents that run 2
turns of their own (while the parent goes on). Every agent submits its next turn as soon
as the previous one finished; all run concurrently through one in-process Scheduler
(the engine's scheduling loop, without sockets).

Ways of running it, side by side:
  sessions   the tool prompt is a Pin, each agent a Session opened from it (fork for the
             sub-agents); a turn sends only the tool result's ids.
  resend     plain prefix cache: each turn re-sends the whole conversation as text, which
             is re-tokenized (the reply's tokens need not survive decode -> encode, so the
             cache can miss from the first token where they differ).
  no-cache   the full token history each turn, under a fresh cache namespace per request
             (nothing ever hits).
and sessions again with the KV pool at 50% of the working set (soft sessions, with and
without the host-memory tier, and with the host tier and the disk tier of a state
directory: durable sessions, whose blocks are written after every turn, which is the
disk tier's cost when nothing restarts).

Oracle: every token computed once: prefill computes only the pinned prompt and each
turn's tool result (replies are computed by decode), replayed exactly over the sessions
run's token sequences by an ideal infinite cache (`ideal_prefill`). Hit rate = prompt tokens served from the cache (device hits +
host-tier restores) / prompt tokens.

    .venv/bin/python benchmarks/bench_sessions.py [--threads 2] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine import wire as engine_msg
from radixlm.runtime.engine.engine_main import build_engine
from radixlm.runtime.model.resolve import resolve_model
from radixlm.runtime.protocol import (
    Error,
    ForkSession,
    SamplingParams,
    SessionOpened,
    SessionsForked,
    Usage,
    decode_server,
)
from radixlm.tokenizer import Tokenizer

CLIENT = b"bench"
WORDS = [
    "the",
    "file",
    "path",
    "returns",
    "error",
    "status",
    "value",
    "config",
    "user",
    "request",
    "token",
    "cache",
    "node",
    "tree",
    "build",
    "test",
    "run",
    "output",
    "input",
    "list",
    "map",
    "key",
    "index",
    "query",
    "result",
    "table",
    "column",
    "row",
    "schema",
    "function",
    "class",
    "method",
    "module",
    "package",
    "import",
    "export",
    "async",
    "await",
    "yield",
    "lambda",
    "return",
    "timeout",
    "retry",
    "backoff",
    "header",
    "payload",
    "json",
    "field",
    "array",
    "object",
    "string",
    "number",
    "boolean",
    "null",
    "commit",
    "branch",
    "merge",
    "diff",
    "patch",
    "line",
    "offset",
    "limit",
    "page",
    "cursor",
    "stream",
    "chunk",
    "batch",
]


# ----------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    agents: int
    turns: int
    reply: int
    tool_prompt: int
    tool_result: tuple[int, int]
    forking_agents: int
    fork_width: int
    fork_after: int  # the parent forks after this many of its turns
    fork_turns: int
    seed: int = 0


def words_text(rng: random.Random, tok: Tokenizer, n_tokens: int, head: str = "") -> str:
    """Text of about `n_tokens` tokens (at least that many, by whole words)."""
    parts = [head]
    while len(tok.encode("".join(parts))) < n_tokens:
        parts.append(" ".join(rng.choice(WORDS) for _ in range(8)) + "\n")
    return "".join(parts)


def tool_prompt_text(rng: random.Random, tok: Tokenizer, n_tokens: int) -> str:
    head = "You are a coding agent. Call tools by replying with JSON. Tools:\n"
    parts = [head]
    i = 0
    while len(tok.encode("".join(parts))) < n_tokens:
        desc = " ".join(rng.choice(WORDS) for _ in range(12))
        args = ", ".join(f'"{rng.choice(WORDS)}": "{rng.choice(WORDS)}"' for _ in range(3))
        parts.append(f'{{"name": "tool_{i}", "description": "{desc}", "args": {{{args}}}}}\n')
        i += 1
    ids = tok.encode("".join(parts))[:n_tokens]
    return tok.decode(ids)


@dataclass
class AgentPlan:
    name: str
    turn_texts: list[str]
    forks_after: int | None  # fork sub-agents after this turn (None: never)
    children: list[AgentPlan] = field(default_factory=list)


def make_plans(w: Workload, tok: Tokenizer) -> tuple[str, list[AgentPlan]]:
    rng = random.Random(w.seed)
    system = tool_prompt_text(rng, tok, w.tool_prompt)

    def turn(who: str, k: int) -> str:
        # Random from the first token: a header shared by every agent's result would be a
        # common prefix that concurrent turns compute side by side (below the in-batch
        # dedup threshold), which the oracle counts once.
        n = rng.randint(*w.tool_result)
        body = words_text(rng, tok, n - 12, rng.choice(WORDS) + " ")
        return f"{body}(tool result for {who}, turn {k})\nReply:"

    plans = []
    for a in range(w.agents):
        p = AgentPlan(f"a{a}", [turn(f"a{a}", k) for k in range(w.turns)], None)
        if a < w.forking_agents:
            p.forks_after = w.fork_after
            p.children = [
                AgentPlan(f"a{a}.{c}", [turn(f"a{a}.{c}", k) for k in range(w.fork_turns)], None)
                for c in range(w.fork_width)
            ]
        plans.append(p)
    return system, plans


# ------------------------------------------------------------------- engine
class InProcessEngine:
    """The engine process's scheduler (sessions, cache, SmolLM2 on CPU), fed messages
    directly, without sockets."""

    def __init__(
        self, model_dir, kv_tokens: int, *, host_kv_tokens: int = 0, retained_cap: int = 0,
        state_dir: str = "",
    ) -> None:
        # Built as `radixlm serve` builds its engine (CPU, float32, torch attention).
        config = EngineConfig(
            model=str(model_dir), device="cpu", dtype="float32", attention="torch",
            page_size=1, kv_tokens=kv_tokens, retained_cap=retained_cap,
            host_kv_tokens=host_kv_tokens, state_dir=state_dir,
        )
        self.engine = build_engine(config, model_dir)
        self.sched = self.engine.scheduler
        self._keys = itertools.count(1)
        self._rids = itertools.count(1)
        self.replies: dict[str, object] = {}
        self.outputs: dict[int, list[int]] = {}
        self.on_done: dict[int, Callable[[list[int]], None]] = {}
        self.usages: dict[int, Usage] = {}
        self.usage_restored = 0
        self.usage_recomputed = 0

    def rid(self) -> str:
        return f"r{next(self._rids)}"

    def submit(
        self,
        ids: list[int],
        done: Callable[[list[int]], None],
        *,
        session: str | None = None,
        namespace: str | None = None,
        max_tokens: int = 32,
    ) -> None:
        key = next(self._keys)
        self.outputs[key] = []
        self.on_done[key] = done
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.sched.handle(
            engine_msg.EngineGenerate(
                key=key,
                client=CLIENT,
                rid=f"g{key}",
                input_ids=ids,
                sampling=sampling,
                session=session,
                namespace=namespace,
            )
        )
        self._collect()

    def call(self, msg) -> object:
        """A message answered with one reply (pin, open, fork); runs until it comes."""
        self.sched.handle(msg)
        rid = msg.rid if not isinstance(msg, engine_msg.EngineCommand) else msg.msg.rid
        self._collect()
        while rid not in self.replies:
            self.step()
        reply = self.replies.pop(rid)
        if isinstance(reply, Error):
            raise RuntimeError(f"{type(msg).__name__} refused: {reply.code}: {reply.message}")
        return reply

    def step(self) -> None:
        self.sched.maybe_tick()
        if self.sched.has_work():
            self.sched.step()
        self._collect()

    def _collect(self) -> None:
        for out in self.sched.take_outbox():
            if isinstance(out, engine_msg.ToClient):
                reply = decode_server(out.data)
                if isinstance(reply, Error) and reply.rid and reply.rid.startswith("g"):
                    raise RuntimeError(f"request {reply.rid} failed: {reply.code}: {reply.message}")
                self.replies[reply.rid] = reply
            elif isinstance(out, engine_msg.StepOutputs):
                for o in out.outputs:
                    self.outputs[o.key] += o.token_ids
                    if o.finish_reason is not None:
                        if o.usage is not None:
                            self.usages[o.key] = o.usage
                            self.usage_restored += o.usage.restored_tokens
                            self.usage_recomputed += o.usage.recomputed_tokens
                        self.on_done.pop(o.key)(self.outputs.pop(o.key))


# -------------------------------------------------------------------- modes
@dataclass
class RunResult:
    name: str
    pool: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    restored: int
    recomputed: int
    retractions: int
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time (all threads): robust to a busy host
    forward_seconds: float  # wall clock inside model forwards
    turns: int
    # (full prompt ids, output ids) of every request, in submission order: the oracle.
    sequences: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Agent:
    """One agent's conversation in one mode; `next_prompt` / `finished` per turn."""

    def __init__(self, plan: AgentPlan, mode: str, tok: Tokenizer, history_text: str,
                 history_ids: list[int], session: str | None) -> None:  # fmt: skip
        self.plan, self.mode, self.tok = plan, mode, tok
        self.text, self.ids, self.session = history_text, history_ids, session
        self.turn = 0

    def request(self) -> tuple[list[int], str | None, list[int]]:
        """(input ids, session, the full prompt they stand for) of the next turn."""
        turn_text = self.plan.turn_texts[self.turn]
        if self.mode == "resend":
            ids = self.tok.encode(self.text + turn_text)
            return ids, None, ids
        appended = self.tok.encode(turn_text)
        if self.mode == "sessions":
            return appended, self.session, self.ids + appended
        return self.ids + appended, None, self.ids + appended

    def finished(self, output: list[int]) -> None:
        turn_text = self.plan.turn_texts[self.turn]
        self.text += turn_text + self.tok.decode(output)
        self.ids = self.ids + self.tok.encode(turn_text) + output
        self.turn += 1


def run_mode(
    mode: str,
    model_dir,
    tok: Tokenizer,
    system: str,
    plans: list[AgentPlan],
    w: Workload,
    kv_tokens: int,
    *,
    host_kv_tokens: int = 0,
    retention: str = "hard",
    label: str | None = None,
    disk: bool = False,
) -> RunResult:
    state = tempfile.TemporaryDirectory(prefix="bench-sessions-") if disk else None
    eng = InProcessEngine(model_dir, kv_tokens, host_kv_tokens=host_kv_tokens,
                          state_dir=state.name if state is not None else "")
    counter = itertools.count()
    system_ids = tok.encode(system)
    start, cpu_start = time.perf_counter(), time.process_time()
    sequences: list[tuple[list[int], list[int]]] = [(list(system_ids), [])]
    pin = None
    if mode == "sessions":
        eng.call(engine_msg.EnginePin(client=CLIENT, rid=eng.rid(), name="tools",
                                      input_ids=system_ids))
        pin = "tools"
    ready: deque[Agent] = deque()
    active = 0

    def launch(plan: AgentPlan, text: str, ids: list[int], session: str | None) -> None:
        nonlocal active
        active += 1
        ready.append(Agent(plan, mode, tok, text, ids, session))

    for plan in plans:
        sid = None
        if mode == "sessions":
            opened = eng.call(
                engine_msg.EngineOpenSession(client=CLIENT, rid=eng.rid(), pinned=pin,
                                             input_ids=[], retention=retention, durable=disk)
            )  # fmt: skip
            assert isinstance(opened, SessionOpened)
            sid = opened.session
        launch(plan, system, list(system_ids), sid)

    def on_done(agent: Agent) -> Callable[[list[int]], None]:
        def done(output: list[int]) -> None:
            nonlocal active
            agent.finished(output)
            plan = agent.plan
            if plan.forks_after == agent.turn:
                sids: list[str | None] = [None] * len(plan.children)
                if mode == "sessions":
                    forked = eng.call(
                        engine_msg.EngineCommand(
                            client=CLIENT,
                            msg=ForkSession(rid=eng.rid(), session=agent.session,
                                            n=len(plan.children)),
                        )
                    )  # fmt: skip
                    assert isinstance(forked, SessionsForked)
                    sids = list(forked.sessions)
                for child, sid in zip(plan.children, sids, strict=True):
                    launch(child, agent.text, list(agent.ids), sid)
            if agent.turn < len(plan.turn_texts):
                ready.append(agent)
            else:
                active -= 1

        return done

    turns = 0
    while active:
        while ready:
            agent = ready.popleft()
            ids, sid, full = agent.request()
            ns = f"nocache-{next(counter)}" if mode == "no-cache" else None
            record: tuple[list[int], list[int]] = (full, [])
            sequences.append(record)

            def done(out: list[int], agent=agent, record=record) -> None:
                record[1].extend(out)
                on_done(agent)(out)

            eng.submit(ids, done, session=sid, namespace=ns, max_tokens=w.reply)
            turns += 1
        eng.step()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    c = eng.sched.counters
    eng.sched.check_integrity()
    eng.engine.close()
    if state is not None:
        state.cleanup()
    return RunResult(
        label or mode,
        kv_tokens,
        c.prompt_tokens,
        c.cached_tokens,
        c.computed_tokens,
        eng.usage_restored,
        eng.usage_recomputed,
        c.retractions,
        seconds,
        cpu_seconds,
        c.forward_s,
        turns,
        sequences,
    )


def estimated_working_set(tok: Tokenizer, system: str, plans: list[AgentPlan], reply: int) -> int:
    """Tokens a sessions run ends up holding (pin + tool results + replies): sizes the
    ample pool before anything ran."""
    n = len(tok.encode(system))
    for p in plans:
        for t in p.turn_texts + [t for c in p.children for t in c.turn_texts]:
            n += len(tok.encode(t)) + reply
    return n


_HASH_MOD, _HASH_BASE = (1 << 61) - 1, 1_000_003


def ideal_prefill(sequences: list[tuple[list[int], list[int]]]) -> tuple[int, int]:
    """(prompt tokens an ideal cache computes, distinct tokens it then holds) for requests
    in submission order: each prompt computes only what no earlier request computed (at
    least its last token, whose logits are needed); a request computes the KV of its
    prompt and of its whole output (the last sampled token too: a session turn feeds it
    through one more decode row). Prefixes are compared by a 61-bit rolling hash."""
    seen: set[tuple[int, int]] = set()
    computed = 0
    for prompt, output in sequences:
        h, hit, hashes = 0, 0, []
        for t in prompt:
            h = (h * _HASH_BASE + t + 1) % _HASH_MOD
            hashes.append(h)
        while hit < len(prompt) - 1 and (hit + 1, hashes[hit]) in seen:
            hit += 1
        computed += len(prompt) - hit
        seen.update((i + 1, x) for i, x in enumerate(hashes))
        for i, t in enumerate(output):
            h = (h * _HASH_BASE + t + 1) % _HASH_MOD
            seen.add((len(prompt) + i + 1, h))
    return computed, len(seen)


WORK = Workload(agents=8, turns=6, reply=32, tool_prompt=1500, tool_result=(100, 300),
                forking_agents=2, fork_width=3, fork_after=3, fork_turns=2)
# --quick: the same shape, small enough for a smoke run.
QUICK = replace(WORK, agents=3, turns=3, reply=8, tool_prompt=150, tool_result=(30, 60),
                forking_agents=1, fork_width=2, fork_after=1, fork_turns=1)


# ------------------------------------------------------------------- report
TARGETS = {
    "sessions": "computed <= 1.02x oracle and >= 3x faster than no-cache",
    "sessions @50% (soft)": "hit rate >= 90% of sessions'",
    "sessions @50% (soft + host tier)": "hit rate >= 90% of sessions'",
    "sessions @50% (soft + host + disk tiers)": "hit rate >= host tier's, time within 5%",
}


def target_met(r: RunResult, oracle: int, by_name: dict[str, RunResult]) -> str:
    sess, nocache = by_name.get("sessions"), by_name.get("no-cache")
    if r.name == "sessions":
        if nocache is None:
            return "pending" if r.computed_tokens <= 1.02 * oracle else "NO"
        ok = r.computed_tokens <= 1.02 * oracle and nocache.seconds / r.seconds >= 3
        ok = ok and nocache.cpu_seconds / r.cpu_seconds >= 3
        return "yes" if ok else "NO"
    host = by_name.get("sessions @50% (soft + host tier)")
    if r.name.endswith("disk tiers)") and host is not None:
        ok = r.hit_rate >= host.hit_rate - 1e-9 and r.seconds <= 1.05 * host.seconds
        return "yes" if ok else "NO"
    if r.name.startswith("sessions @50%") and sess is not None:
        return "yes" if r.hit_rate >= 0.9 * sess.hit_rate else "NO"
    return ""


def table(rows: list[RunResult], oracle: int) -> list[str]:
    by_name = {r.name: r for r in rows}
    nocache = by_name.get("no-cache")
    out = [
        "| run | pool (tokens) | prompt tokens | computed | computed / oracle | hit rate "
        "| restored | recomputed | retractions | job time: wall / CPU / forward (s) "
        "| speed vs no-cache: wall / CPU | target "
        "| met |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        speed = "-"
        if nocache:
            speed = (
                f"{nocache.seconds / r.seconds:.2f}x / {nocache.cpu_seconds / r.cpu_seconds:.2f}x"
            )
        out.append(
            f"| {r.name} | {r.pool:,} | {r.prompt_tokens:,} | {r.computed_tokens:,} | "
            f"{r.computed_tokens / oracle:.3f}x | {r.hit_rate:.1%} | {r.restored:,} | "
            f"{r.recomputed:,} | {r.retractions} | {r.seconds:.0f} / {r.cpu_seconds:.0f} "
            f"/ {r.forward_seconds:.0f} | {speed} | "
            f"{TARGETS.get(r.name, '')} | {target_met(r, oracle, by_name)} |"
        )
    return out


def markdown(args, w: Workload, working: int, oracle: int, rows: list[RunResult],
             load: tuple[float, float]) -> str:  # fmt: skip
    flags = " ".join(sys.argv[1:])
    return "\n".join(
        [
            "# Sessions benchmark (agent workload)",
            "",
            "Command:",
            "",
            f"    .venv/bin/python benchmarks/bench_sessions.py {flags}".rstrip(),
            "",
            f"Workload: {w.agents} agents x {w.turns} turns on a pinned {w.tool_prompt:,}-token "
            f"tool prompt; tool results of {w.tool_result[0]}-{w.tool_result[1]} tokens, "
            f"{w.reply}-token replies (greedy, ignore_eos); {w.forking_agents} agents fork "
            f"{w.fork_width} sub-agents each after their turn {w.fork_after}, which run "
            f"{w.fork_turns} turns. SmolLM2-135M-Instruct (fp32, torch attention backend), "
            f"driven in-process through the Scheduler (no sockets); {args.threads} torch "
            f"thread(s); load average {load[0]:.1f} at the start, {load[1]:.1f} at the end "
            f"({os.cpu_count()} CPUs).",
            "",
            f"Working set {working:,} tokens (distinct KV of the conversations); oracle "
            f"{oracle:,} prompt tokens: every token computed once (prefill: the pinned "
            f"prompt and each tool result; replies come from decode), replayed exactly on "
            f"the sessions run's token sequences. Ample pool "
            f"= estimated working set + 4,096 tokens; the 50% runs use "
            f"{working // 2:,} (retained cap: half of that) with soft sessions; the host tier "
            f"holds {working:,} tokens.",
            "",
            *table(rows, oracle),
            "",
            "- *computed*: prompt tokens run through the model (prefill, recomputes after a "
            "retraction included). *hit rate*: prompt tokens not computed (device hits + "
            "host-tier restores) / prompt tokens. *job time*: pin + opens + every turn, wall "
            "clock, then CPU-seconds of the process (both threads; robust to other load on "
            "a shared host) and wall time inside model forwards. In the cached runs decode "
            "dominates (the torch attention backend gathers every request's whole context "
            "per step); it is the same work in every run.",
            "- *resend* re-tokenizes the whole conversation each turn: where a reply's tokens "
            "do not survive decode -> encode, the cache misses from that token on.",
            "- *no-cache* sends exact token histories under a fresh namespace per request.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="model spec for resolve_model")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true", help="a tiny workload (smoke test)")
    ap.add_argument("--agents", type=int, help="override the number of agents")
    ap.add_argument("--turns", type=int, help="override the turns per agent")
    ap.add_argument("--skip-no-cache", action="store_true", help="omit the slowest baseline")
    ap.add_argument("--out", default="", help="write the results as markdown here")
    args = ap.parse_args(argv)
    w = QUICK if args.quick else WORK
    if args.agents:
        w = replace(w, agents=args.agents, forking_agents=min(w.forking_agents, args.agents))
    if args.turns:
        w = replace(w, turns=args.turns, fork_after=min(w.fork_after, args.turns))
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = Tokenizer.load(model_dir)
    system, plans = make_plans(w, tok)
    ample = estimated_working_set(tok, system, plans, w.reply) + 4096
    load_start = os.getloadavg()[0]
    rows: list[RunResult] = []
    oracle = working = 0
    runs: list[tuple[str, int, dict]] = [("sessions", ample, {})]
    for mode, pool, kw in runs:
        r = run_mode(mode, model_dir, tok, system, plans, w, pool or working // 2, **kw)
        if not oracle:  # the first (ample sessions) run's exact token sequences
            oracle, working = ideal_prefill(r.sequences)
            print(f"working set {working:,} tokens, oracle {oracle:,} prompt tokens", flush=True)
            runs += [
                ("resend", ample, {}),
                ("sessions", 0, {"retention": "soft", "label": "sessions @50% (soft)"}),
                ("sessions", 0, {"retention": "soft", "host_kv_tokens": working,
                                 "label": "sessions @50% (soft + host tier)"}),
                ("sessions", 0, {"retention": "soft", "host_kv_tokens": working, "disk": True,
                                 "label": "sessions @50% (soft + host + disk tiers)"}),
            ]  # fmt: skip
            if not args.skip_no_cache:
                runs.append(("no-cache", ample, {}))
        rows.append(r)
        print(f"  {r.name}: {r.seconds:.1f}s ({r.cpu_seconds:.0f} CPU-s), computed {r.computed_tokens:,}, "
              f"hit rate {r.hit_rate:.1%}", flush=True)  # fmt: skip
        if args.out:  # after every run: partial results survive an interrupted run
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(markdown(args, w, working, oracle, rows, (load_start, os.getloadavg()[0])))
    print("\n".join(table(rows, oracle)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
