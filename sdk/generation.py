"""The operations of a program state that ask the engine for tokens: ``gen`` (one Generate
on the state's session; ``gen(n=k)`` is one Generate with ``n=k``), ``select`` (every
choice scored in its own fork of the session: ``max_tokens=0`` with the prompt logprobs
of the appended choice), and ``separate_reasoning`` (a gen's thinking cut out of the
text and out of the session). Each records the variable, its meta info (SGLang's) and
where the output is.

Run by the state's executor (`StateExecutor`), in the run's event loop.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from radixlm.runtime.protocol import Chunk, Done, Input
from radixlm.sdk.choices import decide
from radixlm.sdk.errors import plain_errors
from radixlm.sdk.options import branch_seed
from radixlm.sdk.reasoning import reasoning_name, split_reasoning
from radixlm.sdk.results import meta_info
from radixlm.sdk.session_handle import APPEND_ONLY
from radixlm.sdk.state_data import GenOutput
from radixlm.sdk.stream_meta import StreamLog

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient
    from radixlm.sdk.executor import StateExecutor
    from radixlm.sdk.lang import Gen, Select, SeparateReasoning

__all__ = ["run_gen", "run_select", "separate_reasoning"]


async def run_gen(state: StateExecutor, op: Gen) -> None:
    data, session, run, client = state.data, state.session, state.run, state.client
    data.open_turn()
    pending = session.pending
    if session.id is not None and len(pending) <= 1:  # the usual case: nothing to push
        last = pending.pop() if pending else None
    else:
        last = await session.push(keep_last=True)
    sampling = run.sampling_for(op.sampling, op.dtype_stop)
    if state.seed_offset and sampling.seed is not None:
        sampling = msgspec.structs.replace(
            sampling, seed=branch_seed(sampling.seed, state.seed_offset))
    defaults = run.gen_defaults
    n = op.n if op.n is not None else defaults.n
    logprob_start = (op.logprob_start_len if op.logprob_start_len is not None
                     else defaults.logprob_start_len)
    # SGLang's logprob_start_len counts in the whole prompt (the state's text); the
    # protocol's start counts from the appended input (negative: into the history).
    plp_start = None
    if logprob_start is not None and sampling.logprobs:
        plp_start = logprob_start - session.length
    texts = op.text_in_logprobs if op.text_in_logprobs is not None else \
        defaults.text_in_logprobs
    stream = run.stream and n == 1
    msg = client.generate_message(last or Input(input_ids=[]), sampling, session=session.id,
                                  n=n, stream=stream, prompt_logprobs_start=plp_start,
                                  logprob_texts=bool(texts))
    name = op.name
    text_start = data.buffer.length
    start = time.perf_counter()
    if n > 1:
        req = client.request(msg)
        try:
            async with req:
                while not req.finished:
                    await req.receive()
        finally:  # every branch got a session of its own, aborted ones included
            session.owned.update(d.session for d in req.dones if d.session is not None)
        dones = sorted(req.dones, key=lambda d: d.index)
        latency = time.perf_counter() - start
        branches = [d.session for d in dones if d.session is not None]
        if branches:
            old = session.id
            session.switch(branches[0], dones[0].session_length,
                           [*branches[1:], *([old] if old else [])])
        data.variables[name] = [d.text for d in dones]
        data.meta[name] = [_gen_meta(d, latency, logprob_start) for d in dones]
        done = dones[0]
        data.add_generated(done.text)
    elif stream:
        data.variables[name] = ""
        log = data.streams[name] = StreamLog(msg.rid)
        got = None
        async with client.request(msg) as req:
            while not req.finished:
                reply = await req.receive()
                if isinstance(reply, Chunk):
                    log.add(reply)
                    data.variables[name] += reply.text
                    data.add_generated(reply.text)
                    run.notify()
                elif isinstance(reply, Done):
                    got = reply
        assert got is not None
        done = got
        session.took(done)
        data.meta[name] = _gen_meta(done, time.perf_counter() - start, logprob_start)
    else:
        done = (await client.run_generate(msg))[0]
        session.took(done)
        data.variables[name] = done.text
        data.meta[name] = _gen_meta(done, time.perf_counter() - start, logprob_start)
        data.add_generated(done.text)
    data.outputs[name] = GenOutput(text_start, data.buffer.length, done.usage.prompt_tokens)
    data.var_done.add(name)


async def run_select(state: StateExecutor, op: Select) -> None:
    data, session, client = state.data, state.session, state.client
    data.open_turn()
    await session.push(keep_last=False)
    forks = await session.fork(len(op.choices))
    session.owned.update(forks)
    dones: list[Done | None] = [None] * len(forks)
    start = time.perf_counter()

    async def score(i: int) -> None:
        msg = client.generate_message(Input(text=op.choices[i]), APPEND_ONLY,
                                      session=forks[i], prompt_logprobs_start=0)
        dones[i] = (await client.run_generate(msg))[0]

    with plain_errors():
        async with anyio.create_task_group() as tg:
            for i in range(len(forks)):
                tg.start_soon(score, i)
            client.cork()  # their requests, one write
    scored = [d for d in dones if d is not None]
    logprobs = [list(d.prompt_logprobs or []) for d in scored]
    unconditional = None
    if getattr(op.method, "requires_unconditional_logprobs", False):
        unconditional = await _unconditional(client, state.run.namespace, op.choices,
                                             [len(lp) for lp in logprobs])
    index, decision_meta = decide(op.method, list(op.choices), logprobs, unconditional)
    history = session.length  # where the chosen choice begins in its session
    old = session.id
    session.switch(forks[index], scored[index].session_length, [*forks, old])
    choice = op.choices[index]
    latency = time.perf_counter() - start
    data.variables[op.name] = choice
    data.meta[op.name] = {
        "choices": list(op.choices),
        "choices_method": getattr(op.method, "name", type(op.method).__name__),
        **decision_meta,
        # Alternatives are not asked for when scoring: one None per token, as SGLang
        # writes a position without them.
        "input_top_logprobs": [[None] * len(lp) for lp in logprobs],
        "prompt_tokens": sum(d.usage.prompt_tokens for d in scored),
        "cached_tokens": sum(d.usage.cached_tokens for d in scored),
        "completion_tokens": 0,
        "finish_reason": {"type": "stop", "matched": None},
        "e2e_latency": latency,
    }
    data.var_done.add(op.name)
    text_start = data.buffer.length
    data.add_generated(choice)
    data.outputs[op.name] = GenOutput(text_start, data.buffer.length, history)


async def _unconditional(client: AsyncClient, namespace: str | None, choices: tuple[str, ...],
                         lengths: list[int]) -> list[list[float | None]]:
    """Each choice's tokens scored with no context (plain requests): the last
    ``len - 1`` logprobs, after a None for the first token (it has no context)."""
    out: list[list[float | None]] = [[] for _ in choices]

    async def one(i: int) -> None:
        msg = client.generate_message(Input(text=choices[i]), APPEND_ONLY, namespace=namespace,
                                      prompt_logprobs_start=0)
        values = list((await client.run_generate(msg))[0].prompt_logprobs or [])
        n = lengths[i]
        tail: list[float | None] = list(values[-(n - 1):]) if n > 1 else []
        out[i] = ([None] * (n - len(tail)) + tail) if n else []

    with plain_errors():
        async with anyio.create_task_group() as tg:
            for i in range(len(choices)):
                tg.start_soon(one, i)
            client.cork()
    return out


async def separate_reasoning(state: StateExecutor, op: SeparateReasoning) -> None:
    """Move each named gen's thinking block into ``<name>_reasoning_content``; the
    state's text and its session keep only the answer (the session is cut back to
    where the gen began and the answer appended, so the model does not see the
    reasoning again, as with SGLang's text). Streamed runs are left as they are."""
    if state.run.stream:
        return
    data, session = state.data, state.session
    for name in op.names:
        value = data.variables.get(name)
        if isinstance(value, list):  # gen(n=k): each branch; the state has the first
            pairs = [split_reasoning(v, op.format) for v in value]
            data.set_var(name, [a for _, a in pairs])
            data.set_var(reasoning_name(name), [r for r, _ in pairs])
            reasoning, answer = pairs[0] if pairs else ("", "")
            value = value[0] if value else ""
        elif isinstance(value, str):
            reasoning, answer = split_reasoning(value, op.format)
            data.set_var(name, answer)
            data.set_var(reasoning_name(name), reasoning)
        else:
            continue
        out = data.outputs.get(name)
        if out is not None and answer != value:
            data.replace_output(out, answer)
            if session.id is not None:
                await session.truncate(out.prompt_tokens, answer)


def _gen_meta(done: Done, latency_s: float, logprob_start: int | None) -> dict[str, Any]:
    """A gen's meta info. ``input_token_logprobs`` as SGLang lists them: the tokens from
    ``logprob_start_len`` on, the first with the logprob None (SGLang's scheduler keeps the
    logprobs from the start's logits on, which predict the tokens after it); at start 0
    that token's id is not known here either (no logprob comes with it)."""
    info = meta_info(done, latency_s)
    triples = info.get("input_token_logprobs")
    if logprob_start is not None and triples is not None:
        if logprob_start == 0:
            info["input_token_logprobs"] = [(None, None, None), *triples]
        elif triples:
            _, token, text = triples[0]
            info["input_token_logprobs"] = [(None, token, text), *triples[1:]]
    return info
