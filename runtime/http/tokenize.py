"""POST /v1/tokenize and /v1/detokenize (also at /tokenize, /detokenize), in vLLM's
shapes: the engine's own tokenization of a prompt or of chat messages rendered by the
model's template (with ``return_token_strs``, each id's string in the vocabulary), and
the text of token ids. All of it is the engine's: this process has no tokenizer."""

from __future__ import annotations

from typing import Any

import msgspec
from radixlm.runtime.http import convert
from radixlm.runtime.http.context import HttpContext, request_body
from radixlm.runtime.http.errors import from_engine, invalid
from radixlm.runtime.http.schemas import DetokenizeRequest, TokenizeRequest
from radixlm.runtime.protocol import Input, Tokenize, Tokens
from radixlm.runtime.transport.errors import EngineError
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()


async def tokenize(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, TokenizeRequest)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        inp = Input(messages=convert.chat_messages(req.messages),
                    add_generation_prompt=req.add_generation_prompt)
    else:
        inp = Input(text=req.prompt)
    try:
        tokens = await ctx.link.call(Tokenize(rid=ctx.link.new_rid(), input=inp,
                                              token_strs=bool(req.return_token_strs)), Tokens)
    except EngineError as e:
        raise from_engine(e) from None
    ids = tokens.input_ids
    body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.context_length,
                            "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = tokens.token_strs or []
    return Response(_json.encode(body), media_type="application/json")


async def detokenize(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, DetokenizeRequest)
    ctx.check_model(req.model)
    try:
        text = await ctx.link.detokenize(req.tokens)
    except EngineError as e:
        raise from_engine(e) from None
    return Response(_json.encode({"prompt": text}), media_type="application/json")
