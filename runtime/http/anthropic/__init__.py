"""Anthropic's Messages API on radixlm's HTTP server (docs/http.md, "Anthropic Messages
API"): ``POST /v1/messages`` (streamed or not), ``POST /v1/messages/count_tokens``, the
models routes in Anthropic's shape, errors in Anthropic's shape, and ``cache_control``
breakpoints held as KV in the requesting tenant's cache for their TTL.

- `schemas`: the request bodies; `convert`: request -> protocol messages, tools,
  sampling and breakpoints; `reply` / `thinking`: the reply's content blocks and events;
  `prompt_cache` / `holds`: breakpoint positions, reads, writes and holds; `messages`:
  the routes; `models`; `errors`.
"""

from radixlm.runtime.http.anthropic.errors import response as error_response
from radixlm.runtime.http.anthropic.messages import MessagesApi
from radixlm.runtime.http.anthropic.models import asks_anthropic, model_or, models_or

__all__ = ["MessagesApi", "asks_anthropic", "error_response", "model_or", "models_or"]
