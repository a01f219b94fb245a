"""POST /v1/completions: plain (legacy) completions of a text or token-id prompt, or of
a batch of them; ``echo`` and per-token ``logprobs`` included."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, Union

import anyio
import msgspec
from radixlm.runtime.http import convert, generation, sse
from radixlm.runtime.http.chat import usage_json
from radixlm.runtime.http.context import HttpContext, now, program_of, request_body
from radixlm.runtime.http.errors import from_engine, invalid
from radixlm.runtime.http.logprobs import completion as completion_logprobs
from radixlm.runtime.http.schemas import CompletionRequest
from radixlm.runtime.protocol import Chunk, Done, Generate, Input, SamplingParams
from radixlm.runtime.transport.errors import EngineError, plain_errors
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()
Prompt = Union[str, list[int]]
MAX_BATCH = 64


def _token_ids(value: Any) -> bool:
    """Whether `value` is a non-empty list of token ids (non-negative, 64-bit at most)."""
    return isinstance(value, list) and bool(value) and all(
        type(t) is int and 0 <= t < 2**63 for t in value)


def prompts_of(prompt: Union[str, list[Any]]) -> list[Prompt]:
    """A prompt, token ids, or a batch of either -> a list of single prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if _token_ids(prompt):
        return [prompt]
    if not prompt or len(prompt) > MAX_BATCH:
        raise invalid(f"prompt must be a string, token ids, or a batch of 1 to {MAX_BATCH} of "
                      "either", "prompt")
    out: list[Prompt] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str) or _token_ids(p):
            out.append(p)
        else:
            raise invalid(f"prompt[{i}] must be a string or a non-empty list of token ids",
                          f"prompt[{i}]")
    return out


async def completions(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, CompletionRequest)
    ctx.check_model(req.model)
    prompts = prompts_of(req.prompt)
    n = convert.n_of(req.n)
    top = req.logprobs
    if top is not None and not 0 <= top <= 20:
        raise invalid(f"logprobs must be in [0, 20], got {top}", "logprobs")
    sampling = convert.sampling(
        req, max_tokens=convert.max_tokens_of(req.max_tokens, ctx.default_max_tokens(), "max_tokens"),
        stop=convert.stop_list(req.stop), logprobs=top is not None, top_logprobs=top or 0)
    echo = bool(req.echo)
    program = program_of(request)
    cid = f"cmpl-{secrets.token_hex(12)}"
    if req.stream:
        if len(prompts) != 1:
            raise invalid("stream supports a single prompt", "prompt")
        msg = await _message(ctx, prompts[0], sampling, n, echo, stream=True, program=program)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        first, rest = await sse.first_then_rest(generation.replies(ctx, msg))
        return sse.response(_stream(ctx, cid, first, rest, include_usage,
                                    await _echo_text(ctx, prompts[0]) if echo else ""))
    results: list[list[Done]] = [[] for _ in prompts]
    ids: list[list[int] | None] = [None] * len(prompts)  # as sent, when echoing logprobs

    async def one(i: int, prompt: Prompt) -> None:
        msg = await _message(ctx, prompt, sampling, n, echo and top is not None, stream=False,
                             program=program)
        ids[i] = msg.input.input_ids
        results[i] = await generation.run(ctx, msg)

    with plain_errors():
        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(one, i, p)
    choices = []
    for i, (prompt, dones) in enumerate(zip(prompts, results, strict=True)):
        head = await _echo_text(ctx, prompt) if echo else ""
        for d in dones:
            choices.append({"index": i * n + d.index, "text": head + d.text,
                            "logprobs": await _logprobs(ctx, d, top, head, ids[i]),
                            "finish_reason": "length" if d.finish_reason == "length" else "stop"})
    usage = usage_json(results[0])
    for dones in results[1:]:
        more = usage_json(dones)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[key] += more[key]
        usage["prompt_tokens_details"]["cached_tokens"] += more["prompt_tokens_details"]["cached_tokens"]
    body = {"id": cid, "object": "text_completion", "created": now(), "model": ctx.model_name,
            "choices": choices, "usage": usage}
    return Response(_json.encode(body), media_type="application/json")


async def _message(ctx: HttpContext, prompt: Prompt, sampling: SamplingParams, n: int,
                   prompt_logprobs: bool, *, stream: bool, program: str | None = None
                   ) -> Generate:
    """The Generate for one prompt; echoed logprobs need the prompt's ids, so a text
    prompt is tokenized first (the engine's own tokenization)."""
    if isinstance(prompt, str) and prompt_logprobs:
        try:
            prompt = await ctx.link.tokenize(Input(text=prompt))
        except EngineError as e:
            raise from_engine(e) from None
    inp = Input(text=prompt) if isinstance(prompt, str) else Input(input_ids=prompt)
    return Generate(rid=ctx.link.new_rid(), input=inp, sampling=sampling, stream=stream, n=n,
                    prompt_logprobs_start=0 if prompt_logprobs else None,
                    logprob_texts=sampling.logprobs, program=program)


async def _echo_text(ctx: HttpContext, prompt: Prompt) -> str:
    """The prompt as echoed: its text, or the engine's text of its token ids."""
    if isinstance(prompt, str):
        return prompt
    try:
        return await ctx.link.detokenize(prompt)
    except EngineError as e:
        raise from_engine(e) from None


async def _logprobs(ctx: HttpContext, done: Done, top: int | None, head: str,
                    prompt: list[int] | None) -> dict[str, Any] | None:
    if top is None:
        return None
    texts = dict(done.token_texts or {})
    if head and prompt:  # the prompt's first token has no logprob, nor a text with them
        for t in {prompt[0]} - texts.keys():
            try:
                texts[t] = await ctx.link.detokenize([t])
            except EngineError as e:
                raise from_engine(e) from None
    out = completion_logprobs(texts, done.token_ids, done.logprobs or [],
                              done.top_logprobs or [None] * len(done.token_ids), len(head))
    if head and done.prompt_logprobs is not None and prompt is not None:
        # The prompt's first token has no logprob: nothing came before it.
        lps: list[float | None] = [None, *done.prompt_logprobs]
        tops: list[Any] = [None, *(done.prompt_top_logprobs or [None] * len(done.prompt_logprobs))]
        before = completion_logprobs(texts, prompt, lps, tops, 0)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            out[key] = before[key] + out[key]
    return out


async def _stream(ctx: HttpContext, cid: str, first: Chunk | Done, rest: AsyncIterator[Any],
                  include_usage: bool, echo: str) -> AsyncIterator[bytes]:
    head = {"id": cid, "object": "text_completion", "created": now(), "model": ctx.model_name}
    dones: list[Done] = []
    echoed: set[int] = set()
    try:
        reply = first
        while True:
            text = reply.text if type(reply) is Chunk else ""
            if echo and reply.index not in echoed:
                echoed.add(reply.index)
                text = echo + text
            finish = None
            if type(reply) is Done:
                dones.append(reply)
                finish = "length" if reply.finish_reason == "length" else "stop"
            lp = None
            if type(reply) is Chunk and reply.logprobs is not None:
                lp = completion_logprobs(reply.token_texts, reply.token_ids, reply.logprobs,
                                         reply.top_logprobs or [None] * len(reply.token_ids), 0)
            yield sse.data({**head, "choices": [{"index": reply.index, "text": text,
                                                 "logprobs": lp, "finish_reason": finish}]})
            try:
                reply = await rest.__anext__()
            except StopAsyncIteration:
                break
        if include_usage and dones:
            yield sse.data({**head, "choices": [], "usage": usage_json(dones)})
        yield sse.DONE
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
