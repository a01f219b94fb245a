"""Structured generation benchmarks on the embedded SmolLM2-135M-Instruct, in-process (the
engine's scheduler, no sockets):

1. ``validity``: 200 samples at temperature 1.0 for each of 5 schemas (nested objects,
   arrays, enums, a regex-pattern date, a tool call forced by ``tool_choice``),
   validated with `jsonschema` (not with xgrammar). Target: 100%.
2. ``overhead``: decode tokens/s at batch 1 and 16 with a JSON Schema vs unconstrained,
   same prompts, greedy, jump-forward off (the mask alone). Target: >= 0.9x.
3. ``jump``: a schema with long fixed keys, jump-forward on vs off: forward steps and
   wall time per request. Target: >= 1.5x fewer decode steps.
4. ``compile``: first vs cached compile time; the inter-token gap of a decoding request
   while another request's ~2-second schema compiles, vs without.

    .venv/bin/python benchmarks/bench_structured.py            # everything (CPU, minutes)
    .venv/bin/python benchmarks/bench_structured.py --quick    # 20 samples per schema
    .venv/bin/python benchmarks/bench_structured.py --part jump

Results and the command go to benchmarks/results_structured.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.engine_main import build_engine
from radixlm.runtime.engine.scheduler import Scheduler
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.wire import EngineGenerate, StepOutputs
from radixlm.runtime.frontend.prepare import TextModel, input_ids
from radixlm.runtime.frontend.structured import plan_structured
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.model import resolve_model
from radixlm.runtime.protocol import Generate, Input, Message, SamplingParams, Tool
from radixlm.tokenizer import Tokenizer
from radixlm.tokenizer.call_parser import CallParser

RESULTS = Path(__file__).with_name("results_structured.md")

NESTED = {"type": "object", "properties": {
    "user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["user", "active"], "additionalProperties": False}  # fmt: skip
ARRAYS = {"type": "object", "properties": {
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
               "minItems": 1, "maxItems": 6},
    "labels": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["scores", "labels"], "additionalProperties": False}  # fmt: skip
ENUMS = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]},
    "size": {"enum": ["S", "M", "L", "XL"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["colour", "size", "count"], "additionalProperties": False}  # fmt: skip
DATE = {"type": "object", "properties": {
    "event": {"type": "string", "maxLength": 24},
    "date": {"type": "string", "pattern": "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"}},
    "required": ["event", "date"], "additionalProperties": False}  # fmt: skip
CALC = Tool(name="calculator", description="Evaluate an arithmetic expression", parameters={
    "type": "object", "properties": {"expression": {"type": "string", "maxLength": 30}},
    "required": ["expression"], "additionalProperties": False})  # fmt: skip
SEARCH = Tool(name="search", description="Search the web", parameters={
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                     "top_k": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["query"], "additionalProperties": False})  # fmt: skip
LONG_KEYS = {"type": "object", "properties": {
    "customer_account_identifier": {"type": "integer", "minimum": 0, "maximum": 9999},
    "preferred_delivery_time_window": {"enum": ["morning", "evening"]},
    "requires_signature_on_delivery": {"type": "boolean"},
    "international_shipping_destination_code": {"enum": ["FR", "DE", "JP"]}},
    "required": ["customer_account_identifier", "preferred_delivery_time_window",
                 "requires_signature_on_delivery", "international_shipping_destination_code"],
    "additionalProperties": False}  # fmt: skip
OVERHEAD = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
              "minItems": 8, "maxItems": 8}},
    "required": ["notes"], "additionalProperties": False}  # fmt: skip


class Bench:
    """The engine's scheduler on SmolLM2, and the frontend's text side for prompts."""

    def __init__(self, threads: int) -> None:
        model_dir = resolve_model("default")
        config = EngineConfig(device="cpu", dtype="float32", kv_tokens=65536, threads=threads)
        self.engine = build_engine(config, model_dir)
        self.sched: Scheduler = self.engine.scheduler
        self.tok = Tokenizer.load(model_dir)
        self.text = TextModel(tokenizer=self.tok, context_length=2048,
                              vocab_size=self.engine.ready.vocab_size)
        self.keys = iter(range(1, 1 << 30))

    def prompt(self, ask: str, tools: list[Tool] | None = None) -> list[int]:
        inp = Input(messages=[Message(role="user", content=ask)])
        return input_ids(self.text, inp, tools=tools)

    def submit(self, ids: list[int], sampling: SamplingParams, grammar: GrammarSpec | None,
               n: int = 1) -> int:
        key = next(self.keys)
        self.sched.handle(EngineGenerate(key=key, client=b"b", rid=str(key), input_ids=ids,
                                         sampling=sampling, n=n, grammar=grammar))
        return key

    def run(self, on_step: Any = None) -> dict[tuple[int, int], list[int]]:
        """Step until idle; the output ids by (key, branch)."""
        out: dict[tuple[int, int], list[int]] = {}
        finish: dict[tuple[int, int], str] = {}
        while self.sched.has_work():
            decode_only = bool(self.sched.running) and not self.sched.waiting and all(
                r.state is ReqState.DECODING for r in self.sched.running)
            t0 = time.perf_counter()
            ran = self.sched.step()
            dt = time.perf_counter() - t0
            produced = 0
            for m in self.sched.take_outbox():
                if isinstance(m, StepOutputs):
                    for o in m.outputs:
                        out.setdefault((o.key, o.index), []).extend(o.token_ids)
                        produced += len(o.token_ids)
                        if o.finish_reason is not None:
                            finish[(o.key, o.index)] = o.finish_reason
            if on_step is not None:
                on_step(ran, decode_only, dt, produced)
            if not ran:
                time.sleep(0.002)
        self.finish = finish
        return out

    def text_of(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def schema_spec(doc: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps(doc))


# ------------------------------------------------------------------ 1. validity
def bench_validity(b: Bench, samples: int) -> list[dict]:
    cases: list[tuple[str, str, GrammarSpec, Any]] = []
    for name, doc, ask in [
        ("nested objects", NESTED, "Give a user with a name, city and zip code as JSON."),
        ("arrays", ARRAYS, "Give some test scores and labels as JSON."),
        ("enums", ENUMS, "Describe a T-shirt as JSON."),
        ("regex date", DATE, "Name an event and its date as JSON."),
    ]:
        cases.append((name, ask, schema_spec(doc), doc))
    call = Generate(rid="x", input=Input(text=""), tools=[CALC, SEARCH], tool_choice="required")
    plan = plan_structured(call, b.text.tool_format)
    assert plan.grammar is not None
    cases.append(("tool call", "What is 17 * 23 + 4?", plan.grammar, json.loads(plan.grammar.text)))
    rows = []
    for name, ask, spec, doc in cases:
        tools = [CALC, SEARCH] if name == "tool call" else None
        ids = b.prompt(ask, tools)
        t0 = time.perf_counter()
        keys = [b.submit(ids, SamplingParams(max_tokens=200, temperature=1.0, seed=i), spec)
                for i in range(samples)]
        outs = b.run()
        wall = time.perf_counter() - t0
        valid = parsed = stopped = 0
        failures: list[str] = []
        for k in keys:
            text = b.text_of(outs[(k, 0)])
            stopped += b.finish[(k, 0)] == "stop"
            try:
                value = json.loads(text)
                parsed += 1
                jsonschema.validate(value, doc)
                if name == "tool call":
                    reader = CallParser(b.text.tool_format, [CALC.name, SEARCH.name])
                    reader.feed(text)
                    reader.finish()
                    assert len(reader.calls) == 1
                valid += 1
            except (json.JSONDecodeError, jsonschema.ValidationError, AssertionError) as e:
                failures.append(f"{text[:80]!r}: {type(e).__name__}")
        rows.append({"schema": name, "samples": samples, "stop": stopped, "parsed": parsed,
                     "valid": valid, "wall_s": wall, "failures": failures[:3]})
        print(f"  {name:15s} {valid}/{samples} valid ({parsed} parse, {stopped} ended by EOS) "
              f"in {wall:.1f}s", flush=True)
    return rows


# ------------------------------------------------------------------ 2. overhead
class GrammarClock:
    """Time spent in the grammar's own work during decoding: the batch mask fill, its
    application to the logits and the matchers' advance (wrapped around the engine's
    `Grammars`; nothing else is timed). Its share of the decode steps is the overhead
    without machine noise, beside the throughput ratio."""

    def __init__(self, grammars: Any) -> None:
        from radixlm.runtime.grammar import bitmask

        self.seconds = 0.0
        self._grammars, self._bitmask = grammars, bitmask
        self._saved = (grammars.mask, grammars.advance, bitmask.TokenMask.apply)
        grammars.mask = self._timed(grammars.mask)
        grammars.advance = self._timed(grammars.advance)
        bitmask.TokenMask.apply = self._timed(bitmask.TokenMask.apply)

    def _timed(self, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper

    def close(self) -> None:
        self._grammars.mask, self._grammars.advance, self._bitmask.TokenMask.apply = self._saved


def decode_rate(b: Bench, batch: int, spec: GrammarSpec | None, tokens: int,
                clock: GrammarClock | None = None) -> tuple[float, float]:
    """Decode tok/s of `batch` identical greedy requests, and the grammar's share of
    the decode steps' time (0 without a grammar)."""
    ids = b.prompt("Write eight short notes about the sea as JSON.")
    gen_tokens = 0
    decode_s = 0.0
    grammar_s = 0.0
    before = clock.seconds if clock is not None else 0.0

    def on_step(ran: bool, decode_only: bool, dt: float, produced: int) -> None:
        nonlocal gen_tokens, decode_s, grammar_s, before
        now = clock.seconds if clock is not None else 0.0
        if ran and decode_only:
            gen_tokens += produced
            decode_s += dt
            grammar_s += now - before
        before = now

    for i in range(batch):
        b.submit(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=spec is None,
                                     seed=i), spec)
    b.run(on_step)
    return gen_tokens / decode_s, grammar_s / decode_s


def bench_overhead(b: Bench, tokens: int, repeats: int) -> list[dict]:
    spec = schema_spec(OVERHEAD)
    b.sched.grammars.compiler.compile_now(spec)  # type: ignore[union-attr]
    rows = []
    grammars = b.sched.grammars
    assert grammars is not None
    grammars.jump_forward = False  # the mask's cost alone
    clock = GrammarClock(grammars)
    try:
        decode_rate(b, 16, spec, 8, clock)  # warm-up: first masks, allocations
        for batch in (1, 16):
            free, constrained, shares = [], [], []
            for _ in range(repeats):  # interleaved: machine noise hits both alike
                free.append(decode_rate(b, batch, None, tokens)[0])
                rate, share = decode_rate(b, batch, spec, tokens, clock)
                constrained.append(rate)
                shares.append(share)
            f, c = statistics.median(free), statistics.median(constrained)
            share = statistics.median(shares)
            rows.append({"batch": batch, "free_tok_s": f, "json_tok_s": c, "ratio": c / f,
                         "ratios": [x / y for x, y in zip(constrained, free, strict=True)],
                         "grammar_share_of_step": share, "mask_only_ratio": 1 - share})
            print(f"  batch {batch:2d}: unconstrained {f:7.1f} tok/s, JSON Schema {c:7.1f} tok/s "
                  f"-> {c / f:.2f}x (rounds {', '.join(f'{x / y:.2f}' for x, y in zip(constrained, free, strict=True))}); "
                  f"grammar work {100 * share:.1f}% of each decode step -> {1 - share:.3f}x "
                  f"from the mask alone", flush=True)
    finally:
        clock.close()
        grammars.jump_forward = True
    return rows


# ---------------------------------------------------------------------- 3. jump
def bench_jump(b: Bench, requests: int) -> dict:
    spec = schema_spec(LONG_KEYS)
    grammars = b.sched.grammars
    assert grammars is not None
    grammars.compiler.compile_now(spec)
    ids = b.prompt("Fill in a delivery record as JSON.")
    res: dict[str, Any] = {}
    for jump in (False, True):
        grammars.jump_forward = jump
        steps = 0
        outs_len = 0
        wall = 0.0
        for i in range(requests):
            forwards = 0

            def on_step(ran: bool, decode_only: bool, dt: float, produced: int) -> None:
                nonlocal forwards
                forwards += ran

            t0 = time.perf_counter()
            k = b.submit(ids, SamplingParams(max_tokens=200, temperature=0.0, seed=i), spec)
            out = b.run(on_step)[(k, 0)]
            wall += time.perf_counter() - t0
            jsonschema.validate(json.loads(b.text_of(out)), LONG_KEYS)
            steps += forwards - 1  # the prefill forward is not a decode step
            outs_len += len(out)
        res["on" if jump else "off"] = {"decode_steps": steps / requests,
                                        "tokens": outs_len / requests, "wall_s": wall / requests}
    grammars.jump_forward = True
    res["step_ratio"] = res["off"]["decode_steps"] / res["on"]["decode_steps"]
    res["wall_ratio"] = res["off"]["wall_s"] / res["on"]["wall_s"]
    print(f"  off: {res['off']['decode_steps']:.1f} decode steps, {res['off']['wall_s']:.2f}s | "
          f"on: {res['on']['decode_steps']:.1f} steps, {res['on']['wall_s']:.2f}s -> "
          f"{res['step_ratio']:.2f}x fewer steps, {res['wall_ratio']:.2f}x wall", flush=True)
    return res


# ------------------------------------------------------------------- 4. compile
def heavy_schema(fields: int, salt: str) -> dict:
    return {"type": "object", "properties": {
        f"{salt}_{i}": {"type": "string", "pattern": f"[a-z]{{2,{5 + i % 7}}}"}
        for i in range(fields)}}  # fmt: skip


def gaps_while(b: Bench, heavy: GrammarSpec | None) -> tuple[float, float, float]:
    """Max and median inter-token gap of a running request while `heavy` (if any)
    compiles; also how long the compile took."""
    ids = b.prompt("Tell a long story.")
    k = b.submit(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), None)
    # Let it reach decoding before the heavy request arrives.
    while not any(r.state is ReqState.DECODING for r in b.sched.running):
        b.sched.step()
    b.sched.take_outbox()
    arrivals: list[float] = []
    compile_s = 0.0
    t_submit = time.perf_counter()
    if heavy is not None:
        b.submit(b.prompt("x"), SamplingParams(max_tokens=1, temperature=0.0), heavy)
    compiling = True
    while b.sched.has_work():
        b.sched.step()
        now = time.perf_counter()
        for m in b.sched.take_outbox():
            if compiling and isinstance(m, StepOutputs) and any(
                    o.key == k and o.token_ids for o in m.outputs):
                arrivals.append(now)
        if compiling and heavy is not None and not b.sched.table.compiling:
            compiling = False
            compile_s = now - t_submit
        if heavy is None and now - t_submit > 3.0:
            compiling = False
    gaps = [y - x for x, y in zip(arrivals, arrivals[1:], strict=False)]
    return max(gaps), statistics.median(gaps), compile_s


def bench_compile(b: Bench, fields: int) -> dict:
    grammars = b.sched.grammars
    assert grammars is not None
    spec = schema_spec(NESTED)
    t0 = time.perf_counter()
    grammars.compiler.compile_now(GrammarSpec(kind="regex", text="warm"))  # tokenizer info
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammars.compiler.compile_now(spec)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        grammars.get(spec)
    cached = (time.perf_counter() - t0) / 100
    base_max, base_med, _ = gaps_while(b, None)
    heavy = schema_spec(heavy_schema(fields, f"f{time.time_ns()}"))
    busy_max, busy_med, compile_s = gaps_while(b, heavy)
    res = {"tokenizer_info_s": info_s, "first_compile_s": first, "cached_lookup_s": cached,
           "heavy_compile_s": compile_s, "gap_max_s": busy_max, "gap_median_s": busy_med,
           "baseline_gap_max_s": base_max, "baseline_gap_median_s": base_med}
    print(f"  tokenizer info {info_s:.2f}s (once, on the compile thread); nested schema first "
          f"compile {first * 1e3:.1f} ms, cached {cached * 1e6:.1f} us", flush=True)
    print(f"  during a {compile_s:.2f}s compile: other request's inter-token gap max "
          f"{busy_max * 1e3:.0f} ms, median {busy_med * 1e3:.0f} ms (without: max "
          f"{base_max * 1e3:.0f} ms, median {base_med * 1e3:.0f} ms)", flush=True)
    return res


def write_results(cmd: str, results: dict) -> None:
    lines = [f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"`{cmd}` on {platform.machine()} ({torch.get_num_threads()} torch threads)\n",
             "```json", json.dumps(results, indent=1), "```\n"]
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["validity", "overhead", "jump", "compile", "all"],
                    default="all")
    ap.add_argument("--quick", action="store_true", help="20 samples per schema, fewer repeats")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    samples = args.samples or (20 if args.quick else 200)
    b = Bench(args.threads)
    results: dict[str, Any] = {}
    parts = ["validity", "overhead", "jump", "compile"] if args.part == "all" else [args.part]
    for part in parts:
        print(f"{part}:", flush=True)
        if part == "validity":
            results[part] = bench_validity(b, samples)
        elif part == "overhead":
            results[part] = bench_overhead(b, tokens=48 if args.quick else 96,
                                           repeats=1 if args.quick else 5)
        elif part == "jump":
            results[part] = bench_jump(b, requests=2 if args.quick else 5)
        else:
            results[part] = bench_compile(b, fields=70)
    if not args.no_write:
        write_results("python benchmarks/bench_structured.py " + " ".join(argv or sys.argv[1:]),
                      results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
