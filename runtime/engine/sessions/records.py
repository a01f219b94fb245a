"""Session and pin records, who owns each, and the locks they hold on the radix tree.

A session's history is cached in the tree and the node at its end is locked, so its
prefix cannot be evicted; `Records` is the one place locks are taken and released for
sessions and pins (`lock_at` locks the new node before it unlocks the old one, so a
shared path is never unprotected in between), and counts every change (`locks_version`,
which the retained-token counts are memoised against).
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from radixlm.cache import MatchResult, PrefixCache, TreeNode
from radixlm.runtime.protocol import ErrorCode, SessionInfo
from radixlm.runtime.rules import RequestError

if TYPE_CHECKING:
    from radixlm.runtime.engine.sessions.tool_waits import ToolWait

HARD, SOFT = "hard", "soft"
# The owner of a durable session whose client is gone: nobody's until a client of its
# tenant resumes it (`Durability.resume`).
DETACHED = b""
EMPTY_IDS = np.zeros(0, dtype=np.int64)
EMPTY_IDS.flags.writeable = False


class Held(NamedTuple):
    """One holder's locked path: its namespace and the cached tokens it pins."""

    namespace: Hashable
    tokens: np.ndarray  # int64; the page-aligned cached part of the holder's history


class Residency(enum.Enum):
    """Whether a session's cached history is retained."""

    HELD = "held"  # the node ending its cached history is locked
    DEMOTED = "demoted"  # lock released: the history is ordinary (late-evicted) cache


def frozen_ids(ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """A private, read-only int64 copy of a flat list of token ids."""
    arr = np.array(ids, dtype=np.int64)  # always a private copy
    if arr.ndim != 1:
        raise RequestError(
            ErrorCode.INVALID_PARAMS, f"token ids must be a flat list, got shape {arr.shape}"
        )
    arr.flags.writeable = False
    return arr


@dataclass(eq=False)
class Session:
    """One open session. Callers read it; only the session package changes it.

    `kv_len` is how much of the history was cached when the session last changed (a turn
    ended, it was opened, forked or truncated): what its next turn should hit. While HELD,
    the first `held_len` of those tokens are locked; that is all of them unless the
    retention cap stopped the lock from moving forward (then the rest is ordinary cache).
    """

    id: str
    client: bytes
    namespace: str | None
    retention: str  # HARD | SOFT
    ttl_s: float | None  # idle time before demotion; None: never
    history: np.ndarray  # int64, read-only: every token of the conversation so far
    residency: Residency
    node: TreeNode | None  # the locked node while HELD (None: nothing locked)
    held_len: int  # tokens locked (0 unless HELD)
    kv_len: int  # tokens of `history` that were cached at the last change
    last_used: float
    busy: bool = False
    turn_kv_len: int = 0  # kv_len when the running turn began (usage reporting)
    priority_raised: bool = False  # part of its path got DEMOTED_PRIORITY
    # Which fork/branch of which session it is (empty: opened directly): seeded turns of
    # sibling forks draw distinct random streams from it (`SessionManager.seed_offset`).
    lineage: tuple[int, ...] = ()
    # What an opening turn with input will hold once prefilled: counted against the
    # retention cap from the open on, so that opens sent back to back cannot all pass.
    reserved: Held | None = None
    # Whether the history ends inside an assistant turn (its header rendered, the model's
    # reply not closed by the template's end-of-turn markup yet): an appended message then
    # takes the rendering that closes it first (`AppendVariants.pick`).
    assistant_open: bool = False
    # Durable (``OpenSession.durable``, on a server with a state directory): kept when its
    # client goes and across restarts (durable.py), resumed by a client of `tenant`.
    durable: bool = False
    tenant: str | None = None  # the frontend's tenant tag of the client that opened it
    # The program its turns belong to (scheduling: policy.py's "program"): its own id, or
    # the one it was opened with; forks and branches inherit it.
    program: str = ""
    # Waiting for the results of the tool calls its last turn ended in (tool_waits.py).
    tool_wait: ToolWait | None = None

    @property
    def length(self) -> int:
        return len(self.history)

    @property
    def held(self) -> Held:
        return Held(self.namespace, self.history[: self.held_len])

    @property
    def wanted(self) -> np.ndarray:
        """The history it expects to find cached (what the host tier may keep for it)."""
        return self.history[: self.kv_len]


@dataclass(eq=False)
class PinnedPrefix:
    name: str
    namespace: str | None
    ids: np.ndarray
    node: TreeNode | None
    held_len: int

    @property
    def held(self) -> Held:
        return Held(self.namespace, self.ids[: self.held_len])


def listed_class(s: Session) -> str:
    """The class a listing shows: "demoted" for a session that holds none of its history
    (demoted, or grown past the retention cap before anything of it could be held)."""
    if s.residency is Residency.DEMOTED or (s.held_len == 0 and s.kv_len > 0):
        return "demoted"
    return s.retention


class Records:
    """Every open session and pin by id/name, their owners, and their locks."""

    def __init__(self, cache: PrefixCache, clock: Callable[[], float]) -> None:
        self.cache = cache
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.pins: dict[str, PinnedPrefix] = {}
        self.locks_version = 0  # bumped on every lock and unlock

    # ------------------------------------------------------------- ownership
    def new_id(self) -> str:
        while True:
            sid = secrets.token_hex(16)  # 128 random bits: unguessable
            if sid not in self.sessions:
                return sid

    def get(self, session_id: str, client: bytes) -> Session:
        """The session, if `client` owns it; otherwise NOT_FOUND (ids of other
        clients are indistinguishable from unknown ones)."""
        s = self.sessions.get(session_id)
        if s is None or s.client != client:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        return s

    def idle(self, session_id: str, client: bytes) -> Session:
        """`get`, refusing a session that runs a turn (BUSY)."""
        s = self.get(session_id, client)
        if s.busy:
            raise RequestError(ErrorCode.BUSY, f"session {session_id!r} has a request in flight")
        return s

    def clone(self, parent: Session, history: np.ndarray, index: int) -> Session:
        """A new session (its parent's `index`-th child) with `parent`'s owner and
        options, holding nothing yet."""
        s = Session(
            id=self.new_id(),
            client=parent.client,
            namespace=parent.namespace,
            retention=parent.retention,
            ttl_s=parent.ttl_s,
            history=history,
            residency=Residency.DEMOTED,
            node=None,
            held_len=0,
            kv_len=0,
            last_used=self.clock(),
            lineage=(*parent.lineage, index),
            assistant_open=parent.assistant_open,
            durable=parent.durable,
            tenant=parent.tenant,
            program=parent.program,
        )
        self.sessions[s.id] = s
        return s

    # ------------------------------------------------------------------ locks
    def lock_node(self, node: TreeNode) -> None:
        self.cache.lock(node)
        self.locks_version += 1

    def unlock_node(self, node: TreeNode) -> None:
        self.cache.unlock(node)
        self.locks_version += 1

    def lock_at(self, s: Session, m: MatchResult) -> None:
        """Lock `m.node` for `s`, then release its previous lock (in that order, so a
        shared path is never unprotected in between)."""
        new = m.node if m.length else None
        if new is not None:
            self.lock_node(new)
        if s.node is not None:
            self.unlock_node(s.node)
        s.node, s.held_len, s.residency = new, m.length, Residency.HELD

    def unlock(self, s: Session) -> None:
        if s.node is not None:
            self.unlock_node(s.node)
        s.node, s.held_len, s.residency = None, 0, Residency.DEMOTED

    def holders(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, Held]]:
        """(class, held path) of every pin and held session but those in `skip`."""
        for pin in self.pins.values():
            yield "pinned", pin.held
        for s in self.sessions.values():
            if s.held_len and s.id not in skip:
                yield s.retention, s.held

    # ------------------------------------------------------------------ list
    def list(self, client: bytes, everyone: bool = False, tenant: str | None = None,
             tier_of: Callable[[Session], str] | None = None) -> list[SessionInfo]:
        """`client`'s sessions (all namespaces) and the detached durable sessions of its
        `tenant` (which it may resume), oldest activity first; with `everyone`, every
        client's, other clients' ids cut to a prefix (ids are the access control: a
        prefix opens nothing). A session waiting on tools names them, and where its
        history is (`tier_of`)."""
        now = self.clock()

        def listed(s: Session) -> bool:
            return everyone or s.client == client or (
                s.client == DETACHED and s.durable and s.tenant == tenant)

        rows = sorted((s for s in self.sessions.values() if listed(s)),
                      key=lambda s: s.last_used)
        return [
            SessionInfo(
                session=s.id if s.client == client or (
                    s.client == DETACHED and s.tenant == tenant) else s.id[:8],
                length=s.length,
                idle_s=0.0 if s.busy else max(0.0, now - s.last_used),
                retention=listed_class(s),
                busy=s.busy,
                namespace=s.namespace,
                durable=s.durable,
                attached=s.client != DETACHED,
                tools=list(s.tool_wait.tools) if s.tool_wait is not None else None,
                tier=tier_of(s) if s.tool_wait is not None and tier_of is not None else None,
            )
            for s in rows
        ]
