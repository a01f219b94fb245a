"""Request bodies of Anthropic's Messages API, as msgspec types.

Decoding a body with these parses and type-checks it (a wrong type is a 400 naming the
field); unknown fields are ignored, as on the OpenAI routes. A content block is one
struct with every block type's fields, so that a block of a type radixlm does not serve
(an image, a document, a server tool's result) decodes and is then refused by name
(`convert.py`), rather than failing to decode with a message about tags.
"""

from __future__ import annotations

from typing import Any, Union

from radixlm.runtime.http.schemas import Body, Int


class CacheControl(Body, kw_only=True):
    type: str = "ephemeral"
    ttl: Union[str, None] = None  # "5m" (the default) or "1h"


class Block(Body, kw_only=True):
    """One content block: text, tool_use, tool_result, thinking, ... (by `type`)."""

    type: str
    text: Union[str, None] = None
    cache_control: Union[CacheControl, None] = None
    citations: Union[list[Any], None] = None
    # tool_use
    id: Union[str, None] = None
    name: Union[str, None] = None
    input: Any = None
    # tool_result: a string or a list of blocks (text only here)
    tool_use_id: Union[str, None] = None
    content: Union[str, list[Block], None] = None
    is_error: Union[bool, None] = None
    # thinking / redacted_thinking (dropped from the prompt: see convert.py)
    thinking: Union[str, None] = None
    signature: Union[str, None] = None
    data: Union[str, None] = None


class InputMessage(Body, kw_only=True):
    role: str
    content: Union[str, list[Block]]


class ToolDef(Body, kw_only=True):
    """A tool: a custom one (``type`` absent or "custom") or a server tool (refused)."""

    name: Union[str, None] = None
    type: Union[str, None] = None
    description: Union[str, None] = None
    input_schema: Union[dict[str, Any], None] = None
    cache_control: Union[CacheControl, None] = None
    strict: Union[bool, None] = None

    @property
    def parameters(self) -> Union[dict[str, Any], None]:
        """The schema, under the name the shared bounds check reads (`bounds.py`)."""
        return self.input_schema


class ToolChoice(Body, kw_only=True):
    type: str  # auto, any, tool, none
    name: Union[str, None] = None
    disable_parallel_tool_use: Union[bool, None] = None


class Thinking(Body, kw_only=True):
    type: str  # enabled, disabled, adaptive, between_tools
    budget_tokens: Union[Int, None] = None
    display: Union[str, None] = None  # "summarized" or "omitted"


class OutputFormat(Body, kw_only=True):
    type: str
    schema: Union[dict[str, Any], None] = None


class OutputConfig(Body, kw_only=True):
    format: Union[OutputFormat, None] = None
    effort: Union[str, None] = None


class Metadata(Body, kw_only=True):
    user_id: Union[str, None] = None


class MessagesRequest(Body, kw_only=True):
    """POST /v1/messages (and, without ``max_tokens``, /v1/messages/count_tokens)."""

    model: Union[str, None] = None
    messages: list[InputMessage]
    max_tokens: Union[Int, None] = None  # required on /v1/messages (checked there)
    system: Union[str, list[Block], None] = None
    tools: Union[list[ToolDef], None] = None
    tool_choice: Union[ToolChoice, None] = None
    stop_sequences: Union[list[str], None] = None
    stream: Union[bool, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    top_k: Union[Int, None] = None
    metadata: Union[Metadata, None] = None
    thinking: Union[Thinking, None] = None
    output_config: Union[OutputConfig, None] = None
    output_format: Union[OutputFormat, None] = None  # the structured-outputs beta's name
    cache_control: Union[CacheControl, None] = None  # automatic caching: the last block
    mcp_servers: Union[list[Any], None] = None  # a server-side feature: refused
    container: Union[Any, None] = None  # code execution containers: refused
    thread: Union[Any, None] = None  # server-side message threads: refused (see convert.py)
    # radixlm's own sampling options (as extra body fields)
    seed: Union[Int, None] = None


__all__ = ["Block", "CacheControl", "InputMessage", "MessagesRequest", "Metadata", "OutputConfig",
           "OutputFormat", "Thinking", "ToolChoice", "ToolDef"]
