"""``cache_control`` held as KV: where each breakpoint falls in the prompt's tokens, what a
request reads and writes by Anthropic's rules, and the holds that make a write real.

**Positions.** The prompt is rendered and tokenized once by the engine (`Tokenize`, with
the tools); the Generate then carries those ids, so nothing is rendered twice. A
breakpoint's prefix is the request cut after its block (`convert.prefix_of`), rendered
without a generation prompt; its position is the number of tokens that rendering shares
with the whole prompt (so whatever the chat template puts where -- most render tools
after the system text -- the prefix is exactly the tokens its blocks determine).
Renderings are memoised per tenant (a system prompt's breakpoint repeats every turn).

**Reads and writes**, as Anthropic counts them (its prompt-caching docs): a request with
breakpoints reads the longest held prefix its prompt starts with that ends at most
`LOOKBACK_BLOCKS` blocks before one of its breakpoints (and no later than it); that is
``cache_read_input_tokens`` -- confirmed by the engine, whose ``cached_tokens`` must
cover it (up to its last whole KV page: the tree shares pages, and with pages of more
than one token the read is what the engine served), or it is not a read (a hold that
was lost is dropped and written again).
Every breakpoint past the read is written: held from now for its TTL. Writes are
``cache_creation_input_tokens`` (the read's end to the last 1-hour breakpoint:
``ephemeral_1h_input_tokens``; from there to the last breakpoint: ``ephemeral_5m``), and
``input_tokens`` is the rest, after the last breakpoint. A write the engine refuses (the
tenant's retention quota is full) is not a write: its tokens count as input.

**Minimum length.** Anthropic caches only prefixes of 1,024-4,096 tokens or more (by
model), a floor set by its billing. Here a hold costs only the KV of its tokens, inside
the tenant's retention quota, so every breakpoint of at least `MIN_CACHEABLE_TOKENS` (1)
is held: a small model's short system prompt is cached too.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from radixlm.runtime.http.anthropic.convert import Converted, prefix_of
from radixlm.runtime.http.anthropic.holds import Hold, PrefixHolds, PrefixKeys, common_prefix, pack
from radixlm.runtime.http.anthropic.schemas import MessagesRequest
from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.errors import from_engine
from radixlm.runtime.http.tenants import Tenant, Tenants
from radixlm.runtime.protocol import (
    Input,
    Message,
    Tokenize,
    Tokens,
    Tool,
    TruncateSession,
)
from radixlm.runtime.transport.errors import EngineError

log = logging.getLogger("radixlm.http.anthropic")

MIN_CACHEABLE_TOKENS = 1
LOOKBACK_BLOCKS = 20  # positions checked per breakpoint, the breakpoint's own included
ONE_HOUR_S = 3600.0
MEMO_ENTRIES = 1024  # renderings memoised, all tenants together
MEMO_BYTES = 32 << 20
MAX_HOLDS = 4096  # holds per tenant (each an engine session): beyond, breakpoints are not held
SWEEP_S = 5.0  # how often expired holds' sessions are closed (the engine demotes on time)
_enc = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Mark:
    """A breakpoint placed in the prompt's tokens."""

    position: int  # the prefix's tokens
    ttl_s: float
    block: int


@dataclass
class TokenizedPrompt:
    ids: list[int]
    keys: PrefixKeys  # digests of its prefixes
    marks: list[Mark]  # in block order, each at least MIN_CACHEABLE_TOKENS long

    @property
    def total(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class CacheUsage:
    total: int
    read: int
    write_1h: int = 0
    write_5m: int = 0

    @property
    def written(self) -> int:
        return self.write_1h + self.write_5m

    def json(self, output_tokens: int) -> dict[str, Any]:
        return {"input_tokens": self.total - self.read - self.written,
                "cache_creation_input_tokens": self.written,
                "cache_read_input_tokens": self.read,
                "cache_creation": {"ephemeral_5m_input_tokens": self.write_5m,
                                   "ephemeral_1h_input_tokens": self.write_1h},
                "output_tokens": output_tokens, "service_tier": "standard"}


def cache_usage(total: int, written: Iterable[Mark], read: int) -> CacheUsage:
    """Anthropic's three positions: A the read, B the last 1-hour write after it, C the last
    write; 1h writes are B - A, 5m writes C - B."""
    marks = list(written)
    c = max([read, *(m.position for m in marks)])
    b = min(c, max([read, *(m.position for m in marks if m.ttl_s >= ONE_HOUR_S)]))
    return CacheUsage(total, read, b - read, c - b)


class RenderMemo:
    """Packed ids of prompt renderings, by a digest of what was rendered (bounded LRU).
    One for every tenant, its keys salted by the tenant: a tenant's hit depends only on
    its own renderings."""

    def __init__(self, entries: int = MEMO_ENTRIES, max_bytes: int = MEMO_BYTES) -> None:
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._entries, self._max_bytes, self._bytes = entries, max_bytes, 0

    def get(self, key: bytes) -> bytes | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: bytes, value: bytes) -> None:
        if len(value) > self._max_bytes or key in self._items:
            return
        self._items[key] = value
        self._bytes += len(value)
        while len(self._items) > self._entries or self._bytes > self._max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= len(old)


@dataclass
class TenantCache:
    link: EngineLink
    holds: PrefixHolds
    renders: RenderMemo  # shared by every tenant
    salt: bytes = b""  # of this tenant's keys in it


class PromptCache:
    """Every tenant's holds and renderings (`of`), and the sweep that closes expired
    holds' sessions."""

    def __init__(self, tenants: Tenants) -> None:
        memo = RenderMemo()
        self._by_name = {t.name: TenantCache(t.link, PrefixHolds(), memo, t.name.encode() + b"\0")
                         for t in tenants}
        self.forced_thinking: bool | None = None  # found at the first request

    def of(self, tenant: Tenant | None) -> TenantCache:
        assert tenant is not None
        return self._by_name[tenant.name]

    def sweep(self) -> int:
        closed = 0
        for tc in self._by_name.values():
            gone = tc.holds.expired()
            if gone:
                tc.link.close_sessions_unawaited([h.session for h in gone])
                closed += len(gone)
        return closed

    async def sweep_forever(self) -> None:
        while True:
            await anyio.sleep(SWEEP_S)
            if self.sweep():
                log.debug("expired breakpoint holds closed")


# -- positions --------------------------------------------------------------------------


async def tokens(ctx: HttpContext, messages: list[Message], tools: list[Tool] | None, *,
                  generation_prompt: bool) -> list[int]:
    msg = Tokenize(rid=ctx.link.new_rid(), input=Input(messages=messages,
                                                  add_generation_prompt=generation_prompt),
                   tools=tools)
    try:
        return (await ctx.link.call(msg, Tokens)).input_ids
    except EngineError as e:
        raise from_engine(e) from None


async def tokenize(ctx: HttpContext, tc: TenantCache, req: MessagesRequest,
                   conv: Converted) -> TokenizedPrompt:
    """The whole prompt's ids, and where its breakpoints fall in them."""
    prompt = conv.prompt
    ids = await tokens(ctx, prompt.messages, prompt.tools, generation_prompt=True)
    packed = pack(ids)
    marks: list[Mark] = []
    if conv.breakpoints:
        renders: list[bytes | None] = [None] * len(conv.breakpoints)
        async with anyio.create_task_group() as tg:
            for i, bp in enumerate(conv.breakpoints):
                tg.start_soon(_render_prefix, ctx, tc, req, bp.cut, renders, i)
        for bp, rendered in zip(conv.breakpoints, renders, strict=True):
            position = common_prefix(rendered, packed) if rendered else 0
            if position >= MIN_CACHEABLE_TOKENS:
                marks.append(Mark(position, bp.ttl_s, bp.block))
    return TokenizedPrompt(ids, PrefixKeys(packed), marks)


async def _render_prefix(ctx: HttpContext, tc: TenantCache, req: MessagesRequest, cut: Any,
                         out: list[bytes | None], i: int) -> None:
    """A breakpoint's prefix rendered (memoised); None when the template refuses it."""
    prefix = prefix_of(req, cut)
    key = hashlib.blake2b(tc.salt + _enc.encode([prefix.messages, prefix.tools]),
                          digest_size=16).digest()
    found = tc.renders.get(key)
    if found is None:
        try:
            found = pack(await tokens(ctx, prefix.messages, prefix.tools,
                                       generation_prompt=False))
        except Exception as e:  # noqa: BLE001 - a prefix the template cannot render alone
            log.debug("breakpoint prefix not rendered: %s", e)
            return
        tc.renders.put(key, found)
    out[i] = found


# -- reads and writes -------------------------------------------------------------------


def candidates(tc: TenantCache, prompt: TokenizedPrompt) -> list[Hold]:
    """Holds the request may read, longest first: its prompt starts with their tokens, and
    each ends within the lookback window of one of its breakpoints."""
    if not prompt.marks:
        return []
    return [h for h in tc.holds.matching(prompt.keys)
            if any(h.length <= m.position and m.block - LOOKBACK_BLOCKS < h.block <= m.block
                   for m in prompt.marks)]


def predict(prompt: TokenizedPrompt, found: list[Hold]) -> CacheUsage:
    """The usage the request will have if its read is confirmed and its writes succeed."""
    read = found[0].length if found else 0
    return cache_usage(prompt.total, [m for m in prompt.marks if m.position > read], read)


def touch(tc: TenantCache, hold: Hold) -> None:
    """A use: the hold's TTL restarts, here and in the engine (a no-op truncate to its own
    length counts as the session's use, which restarts its idle clock)."""
    tc.holds.refresh(hold)
    link = tc.link
    if link.alive:
        link.conn.send_unawaited(TruncateSession(rid=link.new_rid(), session=hold.session,
                                                 length=hold.length))


async def _open(tc: TenantCache, prompt: TokenizedPrompt, mark: Mark) -> Hold | None:
    """A new hold of `mark`'s prefix (a hard session of exactly those tokens: after the
    generation they are all cached, so this prefills nothing); None if refused."""
    link = tc.link
    ids = prompt.ids[: mark.position]
    try:
        opened = await link.open_session(Input(input_ids=ids), retention="hard",
                                         ttl_s=mark.ttl_s)
    except EngineError as e:  # the tenant's quota (capacity), or the engine went away
        log.debug("breakpoint prefix of %d tokens not held: %s", mark.position, e)
        return None
    hold = Hold(opened.session, mark.position, prompt.keys.key(mark.position), mark.block,
                mark.ttl_s, 0.0)
    tc.holds.refresh(hold)
    return hold


async def settle(tc: TenantCache, prompt: TokenizedPrompt, found: list[Hold],
                 cached_tokens: int) -> CacheUsage:
    """After the generation: confirm the read against what the engine served from its
    cache, refresh what was used, hold every breakpoint not held yet; the usage."""
    holds = tc.holds
    page = tc.link.welcome.page_size if tc.link.welcome is not None else 1
    read = 0
    lost = []
    for hold in found:
        # The tree shares whole pages: a held prefix is served up to its last full page.
        if hold.length - hold.length % page <= cached_tokens:
            read = min(hold.length, cached_tokens)
            touch(tc, hold)
            break
        lost.append(hold)
    for hold in lost:
        if holds.drop(hold):
            tc.link.close_sessions_unawaited([hold.session])
    written = []
    for mark in sorted(prompt.marks, key=lambda m: -m.position):
        key = prompt.keys.key(mark.position)
        held = holds.get(mark.position, key)
        if held is not None and held.ttl_s >= mark.ttl_s:
            touch(tc, held)
        elif held is not None or len(holds) < MAX_HOLDS:  # not held, or for less long
            new = await _open(tc, prompt, mark)
            if new is None:
                continue
            old = holds.add(new)
            if old is not None:
                tc.link.close_sessions_unawaited([old.session])
        else:
            continue  # the tenant holds MAX_HOLDS prefixes already: not written
        if mark.position > read:
            written.append(mark)
    return cache_usage(prompt.total, written, read)
