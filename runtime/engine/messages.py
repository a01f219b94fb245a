"""Messages between the frontend process and the engine (scheduler) process.

Internal, not part of the public protocol: the frontend has already decoded, validated
and tokenized the client's request, so the engine sees token ids only. ``client`` is
the ROUTER identity of the client that sent the request; the engine uses it for
session ownership and addresses its replies with it.
"""

from __future__ import annotations

from typing import Union

import msgspec
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.protocol import (
    CloseSession,
    FlushCache,
    ForkSession,
    GetStats,
    ListSessions,
    SamplingParams,
    TopLogprob,
    TruncateSession,
    Unpin,
    Usage,
)


class _Internal(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# --- frontend -> engine -----------------------------------------------------------


class EngineGenerate(_Internal, tag="gen"):
    key: int  # unique per engine lifetime, chosen by the frontend
    client: bytes
    rid: str
    input_ids: list[int]  # the whole prompt, or what to append to `session`
    sampling: SamplingParams
    prompt_logprobs_start: Union[int, None] = None
    priority: int = 0
    namespace: Union[str, None] = None
    session: Union[str, None] = None
    n: int = 1
    # The output's grammar: the request's own regex/json_schema/ebnf, or the tool-call
    # format tool_choice forces (the frontend builds it; the engine compiles it).
    grammar: Union[GrammarSpec, None] = None
    # With `session`: whether the frontend's rendering of the input leaves an assistant
    # turn open (None: the input does not change that, e.g. raw text or ids).
    assistant_open: Union[bool, None] = None


class EngineAbort(_Internal, tag="abort"):
    """The client aborted (or its stream failed): end every branch of ``key``."""

    key: int


class EngineFinishAt(_Internal, tag="finish_at"):
    """A stop string matched in the frontend: finish ``key`` keeping this many tokens."""

    key: int
    keep_tokens: int
    matched_stop: str
    index: int = 0  # the branch (n > 1) the stop string matched in


class EngineOpenSession(_Internal, tag="open"):
    client: bytes
    rid: str
    input_ids: list[int]
    pinned: Union[str, None] = None
    retention: str = "hard"
    ttl_s: Union[float, None] = None
    namespace: Union[str, None] = None
    assistant_open: bool = False  # as on EngineGenerate


class EngineTrimSession(_Internal, tag="trim"):
    """Cut a session back to `length` tokens, quietly (no reply): a stop string matched
    in the frontend after the engine had already ended the turn."""

    client: bytes
    session: str
    length: int


class EnginePin(_Internal, tag="pin"):
    client: bytes
    rid: str
    name: str
    input_ids: list[int]
    namespace: Union[str, None] = None


class EngineCommand(_Internal, tag="cmd"):
    """Requests the engine answers directly (no tokens involved)."""

    client: bytes
    msg: Union[
        ForkSession, TruncateSession, CloseSession, Unpin, ListSessions, GetStats, FlushCache
    ]
    # The client's tenant on a server with several (tenants.py): its engine-side
    # namespaces are this name and names starting with it and "/". A flush is held to
    # them. None: the server's one tenant (everything is its own).
    tenant: Union[str, None] = None


class ClientGone(_Internal, tag="gone"):
    """The client disconnected: abort its requests; its sessions are closed."""

    client: bytes


class Shutdown(_Internal, tag="shutdown"):
    pass


ToEngine = Union[
    EngineGenerate,
    EngineAbort,
    EngineFinishAt,
    EngineOpenSession,
    EngineTrimSession,
    EnginePin,
    EngineCommand,
    ClientGone,
    Shutdown,
]


# --- engine -> frontend -----------------------------------------------------------


class TokenOutput(_Internal):
    """New tokens of one request (or one branch of it) from one scheduler step."""

    key: int
    token_ids: list[int]
    index: int = 0
    logprobs: Union[list[float], None] = None
    top_logprobs: Union[list[list[TopLogprob]], None] = None
    # Set on the last output of a request/branch:
    finish_reason: Union[str, None] = None
    matched_stop: Union[int, str, None] = None
    usage: Union[Usage, None] = None
    prompt_logprobs: Union[list[float], None] = None
    prompt_top_logprobs: Union[list[list[TopLogprob]], None] = None
    session: Union[str, None] = None
    session_length: Union[int, None] = None


class StepOutputs(_Internal, tag="step"):
    """Everything one scheduler step produced, in one message."""

    outputs: list[TokenOutput]


class SessionNote(_Internal):
    """How a session's history ends now, for the frontend's rendering of appends: its
    length (0: empty), last token, and whether the frontend left an assistant turn open
    in it; `closed`: the session is gone."""

    session: str
    client: bytes
    length: int = 0
    last_token: Union[int, None] = None
    assistant_open: bool = False
    closed: bool = False


class SessionNotes(_Internal, tag="notes"):
    """Session changes since the last message, sent before the replies and outputs that
    report them (so the frontend knows a history before its client does)."""

    notes: list[SessionNote]


class ToClient(_Internal, tag="reply"):
    """A complete protocol reply (already msgpack-encoded) for one client; `ends`: the
    key of the Generate this reply ends (an Error refusing or failing it)."""

    client: bytes
    data: bytes
    ends: Union[int, None] = None


class EngineReady(_Internal, tag="ready"):
    model: str
    context_length: int
    page_size: int
    kv_capacity: int
    # The resolved HF-style directory (the frontend loads the tokenizer from it, so the
    # model is resolved once, by the engine) and the model's vocabulary size (input ids
    # must be below it). Empty/0: the frontend resolves `config.model` itself.
    model_dir: str = ""
    vocab_size: int = 0


ToFrontend = Union[StepOutputs, SessionNotes, ToClient, EngineReady]

_encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
to_frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
