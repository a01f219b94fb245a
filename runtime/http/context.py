"""What every route needs, passed explicitly: config, engine link, store, metrics."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.http.metrics import Metrics
from radixlm.runtime.http.store import ConversationStore
from starlette.requests import Request

T = TypeVar("T")


class TokenTexts:
    """Token id -> its text, for logprobs. With no tokenizer at hand the text is
    ``token_id:N`` (the convention vLLM uses for the same case)."""

    def __init__(self, tokenizer_dir: str | None) -> None:
        self._tok = None
        if tokenizer_dir:
            from radixlm.tokenizer import Tokenizer

            self._tok = Tokenizer.load(tokenizer_dir)

    def __call__(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.token_text(token_id)

    def decode(self, token_ids: list[int]) -> str | None:
        """The text of `token_ids`, or None without a tokenizer."""
        return None if self._tok is None else self._tok.decode(token_ids)


@dataclass
class HttpContext:
    config: HttpConfig
    link: EngineLink
    store: ConversationStore
    metrics: Metrics
    tokens: TokenTexts

    @property
    def model_name(self) -> str:
        """--served-model-name, else the engine's model name (a path's last component)."""
        if self.config.served_model_name:
            return self.config.served_model_name
        assert self.link.welcome is not None
        return os.path.basename(self.link.welcome.model.rstrip("/")) or self.link.welcome.model

    @property
    def context_length(self) -> int:
        assert self.link.welcome is not None
        return self.link.welcome.context_length

    def check_model(self, name: str) -> None:
        """Requests name the served model: its id, or the engine's name for it (a path's
        last component will do)."""
        assert self.link.welcome is not None
        engine_name = self.link.welcome.model
        if name not in (self.model_name, engine_name, os.path.basename(engine_name.rstrip("/"))):
            raise ApiError(404, f"The model '{name}' does not exist (this server serves "
                                f"'{self.model_name}')", type="invalid_request_error",
                           param="model", code="model_not_found")

    def default_max_tokens(self) -> int:
        """When a request names no limit: the configured default, at most half the context
        (a longer prompt must then name a smaller limit)."""
        return max(1, min(self.config.default_max_tokens, self.context_length // 2))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes "
                         "(--max-body-bytes)", code="request_too_large")


def decode_body(body: bytes, kind: type[T]) -> T:
    """Parse and type-check a JSON body; a 400 naming the field otherwise."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.split("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_type") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


def now() -> int:
    return int(time.time())
