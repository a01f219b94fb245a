"""The radixlm wire protocol: every message a client and the engine exchange.

One ZeroMQ frame carries one msgpack-encoded message. Messages form a tagged union:
each is a map whose ``"type"`` field names it (``{"type": "generate", ...}``). Token ids
are plain integer arrays, so a client needs neither torch nor this package; see
``docs/protocol.md`` for the socket pattern, ordering and a worked exchange.

Every process and client imports it (the SDK, the HTTP process and the router through
``radixlm.runtime.transport``, the frontend and the engine directly): it must stay free
of torch and of everything else in ``radixlm.runtime``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

PROTOCOL_VERSION = 1

# Limits on what one request may ask for, the same for the frontend, the engine and
# the SDK (all of them import these).
MAX_N = 64  # branches of one Generate (`n`)
MAX_FORK = 64  # sessions one ForkSession makes (`n`)
MAX_CLOSE = 1024  # sessions one CloseSession may name
MAX_TOP_LOGPROBS = 20  # alternatives per position (`top_logprobs`)


def branch_seed(seed: int, index: int) -> int:
    """The seed of branch `index` of a request seeded `seed`: ``seed + index`` (branch i
    of ``n > 1``; a forked session's turns add the engine's offset for their lineage,
    SDK forks their index). Generators take seeds modulo 2**64, so a sum past the
    protocol's range wraps to the same generator. Written once for the engine and the
    SDK."""
    derived = seed + index
    return derived - (1 << 64) if derived >= 1 << 64 else derived


class Struct(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base for wire messages: keyword-only, compact on the wire, strict on input."""


class ToolCall(Struct):
    """One function call the model made: ``arguments`` is a JSON text (an object)."""

    id: str
    name: str
    arguments: str


class CallDelta(Struct):
    """A streamed piece of tool call `index` of a branch (`Chunk.tool_calls`): the call's
    first piece names it (`id`, `name`); `arguments` pieces concatenate to its arguments as
    the model writes them; `done` marks the piece that completes it (the same call, id
    included, is then in the branch's `Done.tool_calls`). `at`: the characters of the
    chunk's `content` that come before this piece."""

    index: int
    at: int = 0
    id: Union[str, None] = None
    name: Union[str, None] = None
    arguments: str = ""
    done: bool = False


def _object_schema() -> dict[str, Any]:
    return {"type": "object"}


class Tool(Struct):
    """A function the model may call; ``parameters`` is the JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=_object_schema)


class NamedToolChoice(Struct):
    """``tool_choice`` naming one function: the output is constrained to a call of it."""

    name: str


ToolChoiceMode = Literal["auto", "none", "required"]


class Message(Struct):
    """One chat message, rendered with the model's chat template.

    An assistant message may carry ``tool_calls`` (then ``content`` may be None); a
    ``tool`` message answers the call ``tool_call_id`` (of function ``name``).
    """

    role: str
    content: Union[str, None] = None
    tool_calls: Union[list[ToolCall], None] = None
    tool_call_id: Union[str, None] = None
    name: Union[str, None] = None


class SamplingParams(Struct):
    """Per-request sampling. ``temperature == 0`` means greedy."""

    max_tokens: Union[int, None] = 128  # None: what is left of the context after the prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Union[int, None] = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    stop_regex: list[str] = []  # Python regexes: the output ends once its text matches one
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many
    ignore_eos: bool = False
    logprobs: bool = False  # logprob of each sampled token
    top_logprobs: int = 0  # and this many alternatives per position
    # Constrained decoding: at most one of these three per request.
    regex: Union[str, None] = None
    json_schema: Union[str, None] = None  # a JSON Schema document, as a JSON text
    ebnf: Union[str, None] = None  # a GBNF/EBNF grammar whose start rule is `root`


# --- client -> engine -------------------------------------------------------------


class Gateway(Struct):
    """A trusted gateway speaking for one of its own users: `token` is the server's
    gateway credential (its private runtime directory's ``gateway.token``, which only the
    server's user can read), and the connection is then `tenant`'s (docs/protocol.md,
    "Tenants"). A wrong token is refused (``forbidden``)."""

    tenant: str  # 1-64 of letters, digits, '_', '-' (relayed: 1-80)
    token: str
    # A router relaying the tenant its own server named (``key-...``, ``gw-...``): the
    # connection is that tenant exactly, not ``gw-`` + `tenant`.
    relayed: bool = False


class Hello(Struct, tag="hello"):
    """First message on a connection; the engine answers `Welcome` or `Error`."""

    protocol_version: int
    client_name: str = ""
    gateway: Union[Gateway, None] = None


class Input(Struct):
    """Exactly one of ``text``, ``input_ids`` or ``messages``.

    Without a session the input is the whole prompt. With a session it is *appended*
    to the session's history: text and ids as they are, messages rendered as a delta
    (only the new messages' template markup; the history is never re-rendered).
    ``add_generation_prompt`` appends the assistant header after ``messages``.
    """

    text: Union[str, None] = None
    input_ids: Union[list[int], None] = None
    messages: Union[list[Message], None] = None
    add_generation_prompt: bool = True


class Generate(Struct, tag="generate"):
    rid: str  # client-chosen, unique among this client's in-flight requests
    input: Input
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    # Logprob of every prompt token from this position on (select() scores with it).
    prompt_logprobs_start: Union[int, None] = None
    priority: int = 0
    namespace: Union[str, None] = None  # cache salt / tenant: disjoint prefix trees
    session: Union[str, None] = None  # append to this session and extend its history
    # n > 1: prefill the prompt once, then sample n branches from it. With a session,
    # the session's history grows by the input only and each branch continues in a new
    # forked session (named in its `Done.session`).
    n: int = 1
    # Functions the model may call, rendered by the model's chat template (`messages`
    # input). "required" or a named function constrains the output to a valid call;
    # "auto" with a grammar (json_schema, ...) to calls or content that follows it.
    tools: Union[list[Tool], None] = None
    tool_choice: Union[ToolChoiceMode, NamedToolChoice] = "auto"
    # False: at most one call per answer ("required": exactly one).
    parallel_tool_calls: bool = True
    # With logprobs: each token's text rides with them (SGLang's return_text_in_logprobs).
    logprob_texts: bool = False
    # The program this request is part of (`--schedule-policy program` admits the programs
    # that have had the least service first). A session's turns belong to its session's
    # program (the one it was opened with, or forked from), whatever this says.
    program: Union[str, None] = None


class Abort(Struct, tag="abort"):
    rid: str  # the request to abort


class GetStats(Struct, tag="stats"):
    rid: str


class FlushCache(Struct, tag="flush_cache"):
    rid: str


Retention = Literal["hard", "soft"]


class OpenSession(Struct, tag="open_session"):
    """Open a session from nothing, from an input (prefilled now), or from a pin."""

    rid: str
    input: Union[Input, None] = None
    pinned: Union[str, None] = None  # start from this named pinned prefix
    retention: Retention = "hard"
    ttl_s: Union[float, None] = None  # idle time after which it is demoted
    namespace: Union[str, None] = None
    # Keep it when this connection goes, and across crashes and restarts (a server with a
    # state directory; `SessionOpened.durable` says whether it is): any connection of
    # the same tenant takes it back with `ResumeSession`.
    durable: bool = False
    # The program its turns belong to (`Generate.program`); nil: the session is a program
    # of its own, and its forks and branches are part of it.
    program: Union[str, None] = None


class ToolDoneSoon(Struct, tag="tool_done_soon"):
    """A hint: the result of the tool call that `session`'s last turn ended in is coming
    soon, so the engine brings the session's history back into its KV cache now (from host
    memory or disk) rather than when the result is appended. Answered `Ok`."""

    rid: str
    session: str


class ResumeSession(Struct, tag="resume_session"):
    """Take a durable session as this connection's own (after a disconnect or a server
    restart); answered with `SessionOpened`. Another tenant's id is not_found."""

    rid: str
    session: str


class ForkSession(Struct, tag="fork_session"):
    rid: str
    session: str
    n: int = 1


class TruncateSession(Struct, tag="truncate_session"):
    rid: str
    session: str
    length: int  # keep this many tokens of history


class CloseSession(Struct, tag="close_session"):
    """Close `session`, or every id in `sessions` (one request, one reply), or both."""

    rid: str
    session: Union[str, None] = None
    sessions: Union[list[str], None] = None

    def ids(self) -> list[str]:
        """The sessions to close, in order: `session` first, then `sessions`."""
        head = [] if self.session is None else [self.session]
        return head + self.sessions if self.sessions else head


class Pin(Struct, tag="pin"):
    """Prefill and hold a named prefix (system or tool prompt) that sessions start from."""

    rid: str
    name: str
    input: Input
    namespace: Union[str, None] = None


class Unpin(Struct, tag="unpin"):
    rid: str
    name: str


class ListSessions(Struct, tag="list_sessions"):
    rid: str
    # Also other clients' sessions, their ids cut to an 8-hex prefix that opens nothing
    # (`radixlm sessions` uses this from a fresh connection).
    all: bool = False


class Tokenize(Struct, tag="tokenize"):
    """Tokenize (and render) an input without running anything."""

    rid: str
    input: Input
    token_strs: bool = False  # also the vocabulary's string of each id (`Tokens.token_strs`)
    # Rendered with `messages` as a Generate's tools are: the prompt a Generate with these
    # tools would have (an HTTP route counts it, and sends its ids).
    tools: Union[list[Tool], None] = None


class Detokenize(Struct, tag="detokenize"):
    """The text of token ids (special tokens included), answered `Detokenized`."""

    rid: str
    token_ids: list[int]


ClientMessage = Union[
    Hello,
    Generate,
    Abort,
    GetStats,
    FlushCache,
    OpenSession,
    ForkSession,
    TruncateSession,
    CloseSession,
    Pin,
    Unpin,
    ListSessions,
    Tokenize,
    Detokenize,
    ResumeSession,
    ToolDoneSoon,
]


# --- engine -> client -------------------------------------------------------------


class Welcome(Struct, tag="welcome"):
    protocol_version: int
    server_version: str
    model: str
    context_length: int
    page_size: int
    kv_capacity: int  # tokens
    # Largest frame the server accepts; a larger one makes it drop the connection. 0 = no limit.
    max_message_bytes: int = 0
    # How the model writes tool calls: "hermes", "llama3" or "generic" (docs/protocol.md).
    tool_format: str = "generic"
    # The server's state directory key (its model fingerprint), "" when it keeps no state:
    # then no session is durable, and nothing outlives a restart.
    state: str = ""


class TopLogprob(Struct, array_like=True):
    """One alternative: ``[token_id, logprob]`` on the wire."""

    token_id: int
    logprob: float


class Chunk(Struct, tag="chunk"):
    """A streamed piece of output (only when ``stream`` was set)."""

    rid: str
    text: str
    token_ids: list[int]
    logprobs: Union[list[float], None] = None
    top_logprobs: Union[list[list[TopLogprob]], None] = None
    index: int = 0  # branch index when n > 1
    # With logprob_texts: the text of every token id in this chunk's ids and logprobs.
    token_texts: Union[dict[int, str], None] = None
    # With tools whose calls are parsed: the output read as it streams -- `content`, the
    # text outside tool calls (set on every chunk, "" when there is none), and pieces of
    # calls, each placed in `content` by its `at`. `text` stays the raw output.
    content: Union[str, None] = None
    tool_calls: Union[list[CallDelta], None] = None


class Usage(Struct):
    prompt_tokens: int  # tokens in this request's full prompt (session history included)
    cached_tokens: int  # of those, served from the prefix cache (not computed)
    completion_tokens: int
    # With a demoted session: history tokens recomputed because they had been evicted,
    # and history tokens restored from the host-memory tier.
    recomputed_tokens: int = 0
    restored_tokens: int = 0


FinishReason = Literal["stop", "length", "abort"]


class Done(Struct, tag="done"):
    """The end of a request: its whole output and usage."""

    rid: str
    finish_reason: FinishReason
    text: str
    token_ids: list[int]
    usage: Usage
    # What stopped it: a stop string, a stop token id, or None (EOS counts as a stop id).
    matched_stop: Union[str, int, None] = None
    logprobs: Union[list[float], None] = None
    top_logprobs: Union[list[list[TopLogprob]], None] = None
    prompt_logprobs: Union[list[float], None] = None  # from prompt_logprobs_start on
    prompt_top_logprobs: Union[list[list[TopLogprob]], None] = None
    prompt_token_ids: Union[list[int], None] = None  # the tokens of prompt_logprobs
    # With logprob_texts: the text (decoded alone) of every token id in the output, its
    # top alternatives and the prompt's logprobs.
    token_texts: Union[dict[int, str], None] = None
    session: Union[str, None] = None  # the session this branch's history lives in
    session_length: Union[int, None] = None  # its history length after this turn
    index: int = 0  # branch index when n > 1 (one Done per branch)
    # The complete function calls read from the output, with the ids their streamed
    # pieces carried (`text` keeps the raw output).
    tool_calls: Union[list[ToolCall], None] = None


class ErrorCode:
    """Stable error codes (the ``code`` field of `Error`)."""

    BAD_MESSAGE = "bad_message"  # not msgpack, or not a valid message
    UNKNOWN_TYPE = "unknown_type"  # a "type" this engine does not know
    UNSUPPORTED_VERSION = "unsupported_version"
    HANDSHAKE_REQUIRED = "handshake_required"
    INVALID_PARAMS = "invalid_params"  # sampling values, n, lengths...
    EMPTY_PROMPT = "empty_prompt"
    TOO_LONG = "too_long"  # prompt + max_tokens beyond the context or the pool
    NOT_FOUND = "not_found"  # unknown rid, session or pin
    DUPLICATE_ID = "duplicate_id"  # rid already in flight, pin name taken
    BUSY = "busy"  # the session already has a request in flight
    CAPACITY = "capacity"  # retention cap reached, or the pool cannot hold it
    NO_TEMPLATE = "no_template"  # messages given but the model has no chat template
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the engine process stopped answering
    FORBIDDEN = "forbidden"  # not allowed for this client (reserved: nothing sends it now)
    INTERNAL = "internal"


class Error(Struct, tag="error"):
    rid: Union[str, None]
    code: str
    message: str


class Ok(Struct, tag="ok"):
    rid: str


class Histogram(Struct):
    """Observations of one duration, in seconds, as Prometheus buckets them: `counts[i]`
    fell in (`bounds[i-1]`, `bounds[i]`], the last count above every bound."""

    bounds: list[float]  # ascending upper bounds
    counts: list[int]  # per bucket (not cumulative): len(bounds) + 1
    sum: float
    count: int


class StatsReply(Struct, tag="stats_reply"):
    rid: str
    capacity: int
    free: int
    evictable: int
    protected: int
    private: int  # held by running requests, not in the tree
    retained_tokens: dict[str, int]  # by retention class: "pinned", "hard", "soft"
    retained_cap: int
    host_capacity: int
    host_used: int
    sessions: int
    pins: int
    running: int
    waiting: int
    prompt_tokens_total: int
    cached_tokens_total: int
    hit_rate: float
    invariant_ok: bool  # free + evictable + protected + private == capacity
    generated_tokens_total: int  # sampled (or jumped-forward) output tokens
    retractions: int  # running requests sent back to the queue (their KV kept as cache)
    fair_preemptions: int  # of those, to give another client its share of running slots
    capped_steps: int  # decode steps that held rows back for another client's latency
    # Generate branches that ended, by finish reason ("stop", "length", "abort").
    finish_reasons: dict[str, int]
    # Per-request timings measured in the engine (every protocol, streamed or not), by
    # name: request_queue_time, time_to_first_token, e2e_request_latency,
    # request_prefill_time, request_decode_time, request_time_per_output_token.
    latency: dict[str, Histogram]
    # Sessions whose last turn ended in tool calls, waiting for the result, by where their
    # history is: "device" (all in the KV pool), "host", "disk", "recompute" (some of it
    # in no tier).
    tool_waits: dict[str, int] = {}
    # The engine's running estimate of each tool's round trip (the turn ending in its call
    # -> the result appended), in seconds, by tool name.
    tool_round_trip_s: dict[str, float] = {}
    # Tool-paused histories brought back into the KV pool: "started" (prefetches begun:
    # on a hint, or as the estimate says the result is near), "hinted" (tool_done_soon
    # received), "hits" (a result appended found its demoted history back in the pool),
    # "misses" (it had to be copied in or recomputed when the result came).
    prefetch: dict[str, int] = {}


class SessionOpened(Struct, tag="session_opened"):
    rid: str
    session: str
    length: int
    cached_tokens: int = 0
    durable: bool = False  # saved in the state directory before this reply was sent


class SessionsForked(Struct, tag="sessions_forked"):
    rid: str
    sessions: list[str]
    length: int = 0  # the history length of each new session (its parent's)


class Pinned(Struct, tag="pinned"):
    rid: str
    name: str
    length: int


class SessionInfo(Struct):
    session: str  # id (full; `radixlm sessions` prints a prefix)
    length: int
    idle_s: float
    retention: str  # "hard", "soft", or "demoted"
    busy: bool
    namespace: Union[str, None] = None
    durable: bool = False
    attached: bool = True  # False: a durable session nobody holds (resume it to use it)
    # Waiting on the tools its last turn called (their names; nil: not waiting), and where
    # its history is meanwhile: "device", "host", "disk" or "recompute".
    tools: Union[list[str], None] = None
    tier: Union[str, None] = None


class SessionList(Struct, tag="session_list"):
    rid: str
    sessions: list[SessionInfo]


class Tokens(Struct, tag="tokens"):
    rid: str
    input_ids: list[int]
    # With `Tokenize.token_strs`: each id's string in the vocabulary (as transformers'
    # `convert_ids_to_tokens`: "Ġword" for a byte-level BPE), "" for an id without one.
    token_strs: Union[list[str], None] = None


class Detokenized(Struct, tag="detokenized"):
    rid: str
    text: str


ServerMessage = Union[
    Welcome,
    Chunk,
    Done,
    Error,
    Ok,
    StatsReply,
    SessionOpened,
    SessionsForked,
    Pinned,
    SessionList,
    Tokens,
    Detokenized,
]

_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


def decode_client(data: bytes) -> ClientMessage:
    """Decode a client frame; raises ``msgspec.DecodeError``/``ValidationError``."""
    return _client_decoder.decode(data)


def decode_server(data: bytes) -> ServerMessage:
    return _server_decoder.decode(data)


CLIENT_TYPES: frozenset[str] = frozenset(t.__struct_config__.tag for t in ClientMessage.__args__)
