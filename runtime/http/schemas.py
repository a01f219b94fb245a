"""Request bodies of the OpenAI-compatible routes, as msgspec types.

Decoding a body with these both parses and type-checks it (a wrong type is a 400 naming
the field). Fields OpenAI defines that radixlm does not use are simply absent here, and
unknown fields are ignored, as OpenAI's servers do. ``X | None`` throughout: clients
send explicit ``null`` for options they leave unset.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

# Integers are bounded where they are decoded: JSON integers have no size, the wire's
# msgpack has 64 bits, and a value past them is the client's error (400), not ours.
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class Body(msgspec.Struct, kw_only=True):
    """Base of request bodies: keyword-only, unknown fields ignored."""


# -- chat completions ------------------------------------------------------------------


class ContentPart(Body, kw_only=True):
    type: str
    text: Union[str, None] = None


class FunctionCall(Body, kw_only=True):
    name: str
    arguments: str = ""


class ChatToolCall(Body, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(Body, kw_only=True):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Union[str, None] = None
    tool_calls: Union[list[ChatToolCall], None] = None
    tool_call_id: Union[str, None] = None


class FunctionDef(Body, kw_only=True):
    name: str
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None


class ChatTool(Body, kw_only=True):
    type: str = "function"
    function: FunctionDef


class NamedFunction(Body, kw_only=True):
    name: str


class ChatToolChoice(Body, kw_only=True):
    type: str = "function"
    function: NamedFunction


class JsonSchemaSpec(Body, kw_only=True):
    name: str = "response"
    schema: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class ResponseFormat(Body, kw_only=True):
    type: str
    json_schema: Union[JsonSchemaSpec, None] = None


class StreamOptions(Body, kw_only=True):
    include_usage: Union[bool, None] = None


class SessionSpec(Body, kw_only=True):
    """radixlm's extension: continue (``id``), fork (``fork``) or open (no ``id``) a
    stored conversation whose history is held in the engine."""

    id: Union[str, None] = None
    fork: bool = False


class SamplingExtras(Body, kw_only=True):
    """Options shared by the three generation routes (OpenAI's names, plus a few of
    radixlm's own sampling options, which OpenAI clients can pass as extra body)."""

    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    seed: Union[Int, None] = None
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    stop_token_ids: Union[list[Int], None] = None
    top_k: Union[Int, None] = None
    min_p: Union[float, None] = None
    repetition_penalty: Union[float, None] = None
    ignore_eos: Union[bool, None] = None
    user: Union[str, None] = None


class CompletionOptions(SamplingExtras, kw_only=True):
    """What chat and plain completions share."""

    model: Union[str, None] = None  # optional: the one served model
    stream: Union[bool, None] = None
    stream_options: Union[StreamOptions, None] = None
    n: Union[Int, None] = None
    max_tokens: Union[Int, None] = None
    stop: Union[str, list[str], None] = None


class ChatCompletionRequest(CompletionOptions, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Union[Int, None] = None
    logprobs: Union[bool, None] = None
    top_logprobs: Union[Int, None] = None
    response_format: Union[ResponseFormat, None] = None
    tools: Union[list[ChatTool], None] = None
    tool_choice: Union[str, ChatToolChoice, None] = None
    parallel_tool_calls: Union[bool, None] = None
    session: Union[SessionSpec, None] = None


# -- completions -----------------------------------------------------------------------


class CompletionRequest(CompletionOptions, kw_only=True):
    prompt: Union[str, list[Any]]  # text, token ids, or a batch of either (checked later)
    echo: Union[bool, None] = None
    logprobs: Union[Int, None] = None  # this many alternatives per token (0-20)


# -- responses -------------------------------------------------------------------------


class InputContent(Body, kw_only=True):
    type: str
    text: Union[str, None] = None


class InputItem(Body, kw_only=True):
    """One item of a Responses ``input`` list: a message, or a function call / output."""

    type: Union[str, None] = None  # "message" (the default), "function_call", "function_call_output"
    id: Union[str, None] = None
    role: Union[str, None] = None
    content: Union[str, list[InputContent], None] = None
    call_id: Union[str, None] = None
    name: Union[str, None] = None
    arguments: Union[str, None] = None
    output: Union[str, list[InputContent], None] = None


class TextFormat(Body, kw_only=True):
    type: str = "text"
    name: Union[str, None] = None
    schema: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class TextConfig(Body, kw_only=True):
    format: Union[TextFormat, None] = None


class ResponseTool(Body, kw_only=True):
    type: str = "function"
    name: str
    description: Union[str, None] = None
    parameters: Union[dict[str, Any], None] = None
    strict: Union[bool, None] = None


class ResponseToolChoice(Body, kw_only=True):
    type: str = "function"
    name: Union[str, None] = None


class ConversationRef(Body, kw_only=True):
    id: str


class ResponsesRequest(SamplingExtras, kw_only=True):
    model: Union[str, None] = None
    input: Union[str, list[InputItem]]
    instructions: Union[str, None] = None
    previous_response_id: Union[str, None] = None
    conversation: Union[str, ConversationRef, None] = None
    store: Union[bool, None] = None
    tool_choice: Union[str, ResponseToolChoice, None] = None
    tools: Union[list[ResponseTool], None] = None
    parallel_tool_calls: Union[bool, None] = None
    stream: Union[bool, None] = None
    max_output_tokens: Union[Int, None] = None
    text: Union[TextConfig, None] = None
    metadata: Union[dict[str, str], None] = None
    top_logprobs: Union[Int, None] = None


# -- conversations ---------------------------------------------------------------------


class ConversationCreate(Body, kw_only=True):
    items: Union[list[InputItem], None] = None
    metadata: Union[dict[str, str], None] = None


class ConversationUpdate(Body, kw_only=True):
    metadata: dict[str, str]


class ItemsCreate(Body, kw_only=True):
    items: list[InputItem]


# -- tokenize / detokenize (vLLM's shapes) ---------------------------------------------


class TokenizeRequest(Body, kw_only=True):
    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[list[ChatMessage], None] = None
    add_generation_prompt: bool = True
    return_token_strs: Union[bool, None] = None


class DetokenizeRequest(Body, kw_only=True):
    model: Union[str, None] = None
    tokens: list[Int]
