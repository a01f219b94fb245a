"""Messages between the frontend process and the engine (scheduler) process.

Internal, not part of the public protocol: the frontend has already decoded, validated
and tokenized the client's request, so the engine sees token ids only. ``client`` is
the ROUTER identity of the client that sent the request; the engine uses it for
session ownership and addresses its replies with it.

Neutral ground: both processes import this module, and it imports only the protocol and
the grammar spec (never torch, nothing of the engine or the frontend).

The engine ends every turn (EOS, length, stop ids, stop strings, grammar) and owns every
session's history; the frontend keeps no record of either. An input appended to a
session is rendered by the frontend for each way the history may end (`AppendVariants`)
and the engine, which knows how it ends, picks one.
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
    ResumeSession,
    SamplingParams,
    ToolDoneSoon,
    TopLogprob,
    TruncateSession,
    Unpin,
    Usage,
)


class _Internal(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# --- frontend -> engine -----------------------------------------------------------


class Variant(_Internal, array_like=True):
    """Token ids of an input for one way a session's history may end: put before the
    input's own ids, or (`whole`) instead of them."""

    ids: list[int]
    whole: bool = False

    def apply(self, input_ids: list[int]) -> list[int]:
        return self.ids if self.whole else self.ids + input_ids


class AppendVariants(_Internal):
    """An input appended to a session, rendered for the ends of history other than a
    closed turn (`EngineGenerate.input_ids` is the rendering that follows one): an empty
    history (a full render: BOS, the template's default system prompt), and an assistant
    turn left open (its closing markup first; `if_open_after`: when the history already
    ends with that end-of-turn token, whose text the markup then leaves out). None: the
    same ids as after a closed turn. `*_error`: the template cannot render the input for
    that end (the engine refuses the turn with invalid_params if the history has it)."""

    if_empty: Union[Variant, None] = None
    if_open: Union[Variant, None] = None
    if_open_after: Union[dict[int, Variant], None] = None
    empty_error: Union[str, None] = None
    open_error: Union[str, None] = None
    closed_error: Union[str, None] = None

    def pick(self, input_ids: list[int], length: int, last_token: int | None,
             assistant_open: bool) -> list[int]:
        """The ids to append to a history of `length` tokens ending with `last_token`,
        whose last turn is an open assistant turn iff `assistant_open`; raises ValueError
        with the template's message when it cannot render that."""
        variant = None
        if length == 0:
            if self.empty_error is not None:
                raise ValueError(self.empty_error)
            variant = self.if_empty
        elif assistant_open:
            if self.open_error is not None:
                raise ValueError(self.open_error)
            after = self.if_open_after
            variant = after.get(last_token) if after and last_token is not None else None
            if variant is None:
                variant = self.if_open
        elif self.closed_error is not None:
            raise ValueError(self.closed_error)
        return input_ids if variant is None else variant.apply(input_ids)


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
    # With `session`: whether the input, once appended, leaves an assistant turn open
    # (messages ending with the assistant header; None: it does not change that, e.g. raw
    # text or ids), and its renderings for the ends of history other than a closed turn.
    assistant_open: Union[bool, None] = None
    variants: Union[AppendVariants, None] = None
    # When the frontend received the request (`time.monotonic()`, before tokenizing):
    # the start of its time to first token and end-to-end latency (engine/timings.py).
    arrived: Union[float, None] = None
    # The names of the tools whose calls are read from its output (the request's tools,
    # unless tool_choice is "none"): a session turn ending in calls of them waits on them.
    tools: Union[list[str], None] = None
    # The client's program (`Generate.program`, in the client's scope); a session's turns
    # belong to the session's program instead.
    program: Union[str, None] = None


class EngineAbort(_Internal, tag="abort"):
    """The client aborted (or its stream failed): end every branch of ``key``."""

    key: int


class EngineOpenSession(_Internal, tag="open"):
    client: bytes
    rid: str
    input_ids: list[int]
    pinned: Union[str, None] = None
    retention: str = "hard"
    ttl_s: Union[float, None] = None
    namespace: Union[str, None] = None
    assistant_open: bool = False  # as on EngineGenerate
    durable: bool = False
    tenant: Union[str, None] = None  # the client's tenant tag (who may resume it)
    program: Union[str, None] = None  # as on EngineGenerate


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
        ForkSession, TruncateSession, CloseSession, Unpin, ListSessions, GetStats, FlushCache,
        ResumeSession, ToolDoneSoon,
    ]
    # The client's tenant on a server with several (tenants.py): its engine-side
    # namespaces are this name and names starting with it and "/". A flush is held to
    # them; a durable session is resumed and listed by its tenant's clients only. None:
    # the server's one tenant (everything is its own).
    tenant: Union[str, None] = None


class ClientGone(_Internal, tag="gone"):
    """The client disconnected: abort its requests; its sessions are closed (durable ones
    are detached: kept for its tenant to resume)."""

    client: bytes


class Shutdown(_Internal, tag="shutdown"):
    pass


class FrontendHello(_Internal, tag="frontend_hello"):
    """A frontend process (re)started: every client the engine knows is gone (their
    requests are aborted, their sessions closed or, durable, detached), and the engine
    answers with its `EngineReady` again (a restarted frontend needs it)."""

    boot: str  # the frontend process's own random id, for the log


ToEngine = Union[
    EngineGenerate,
    EngineAbort,
    EngineOpenSession,
    EnginePin,
    EngineCommand,
    ClientGone,
    FrontendHello,
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
    prompt_token_ids: Union[list[int], None] = None  # the tokens of prompt_logprobs
    # A stop string matched inside the last kept token: its text's last `text_trim`
    # characters are the stop string's start, which the output's text leaves out.
    text_trim: int = 0
    session: Union[str, None] = None  # the session the branch's history lives in
    session_length: Union[int, None] = None  # that history's length after the turn


class StepOutputs(_Internal, tag="step"):
    """Everything one scheduler step produced, in one message."""

    outputs: list[TokenOutput]


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
    state: str = ""  # the state folder's fingerprint ("" without state): Welcome.state
    # This engine process's random id: an `EngineReady` with another one while serving
    # means the engine restarted (the requests it was running are lost).
    boot: str = ""


class EngineBoot(_Internal, tag="boot"):
    """Sent by an engine process as it starts, before it loads anything: a frontend that
    sees a boot id other than its engine's knows that engine died, and fails what it was
    running at once (what is sent from then on waits for the new engine)."""

    boot: str


ToFrontend = Union[StepOutputs, ToClient, EngineReady, EngineBoot]

_encoder = msgspec.msgpack.Encoder()
to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
to_frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
