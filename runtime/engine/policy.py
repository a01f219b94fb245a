"""Which waiting requests to admit first, and which to hold back (in-batch dedup).

Policies (SGLang's names):
- ``fcfs``: arrival order; no prefix matching needed to order.
- ``lpm``: longest cached prefix first, so requests that hit the tree run while their
  prefix is still there.
- ``dfs-weight``: walk the tree depth-first, heaviest subtree (most waiting requests)
  first, so requests sharing a prefix run back to back.
- ``shortest-prefill-first``: least uncached work first.
- ``program``: programs scheduled as programs (Autellix's program-level attained service,
  in its discretised form): a program's level is how many doublings of `quantum` tokens
  of service (prompt and output tokens computed for it) it has had, capped at `levels` -
  1; the lowest level first, and within a level first come, first served by *program*
  arrival (its first request's), so a short agent program passes long ones across levels
  while programs of one level finish in the order they came instead of all together.
  A session's turns, its forks' and its branches' are one program (the session it was
  opened as, `Session.program`); other requests name theirs (`Generate.program`) or are
  programs of their own. Anti-starvation (Autellix's promotion of long waiters): a
  request that has waited `starve_s` is ordered as if its program were on the first
  level -- so, within its priority and client, once a request has waited `starve_s` only
  requests of programs that came before its own (and its own program's earlier ones)
  are admitted before it: no stream of newer programs, however short, starves an older
  one. Promotion keeps first come, first served by program among the promoted, so a
  long wait under load does not turn the order back into every program's turn in
  rotation. Where prefill is preemptible, a step's prompt work is one program's and a
  slice waits for the decodes of programs ranked above its own (prefill.py).

All orders put higher `priority` first and break ties by arrival. Prefix-aware orders
match every waiting request each step; above `max_matched` waiting requests they fall
back to FCFS (matching a long queue every step would cost more than it saves).

Fairness across clients: within a priority, admission goes round-robin over clients (each
client's first request in the policy's order, then each one's second, ...; among equals,
the client admission served least recently first), so one client's queue, however long,
cannot starve another's requests. And running slots are shared: when every slot is taken
and a client with requests waiting holds fewer than its fair share (`max_running` over
the clients with work), `fair_victims` names the newest running requests of the clients
holding the most beyond their share, which the scheduler retracts (their KV stays in the
tree as cache, so they resume almost where they were). One client alone still gets every
slot.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import get_args

from radixlm.cache import TreeNode
from radixlm.cache.pages import align_down
from radixlm.runtime.config import SchedulePolicy
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.request import Request
from radixlm.runtime.engine.sessions.retention import common_prefix_len
from radixlm.runtime.engine.state import TERMINAL, ReqState

POLICIES: tuple[str, ...] = get_args(SchedulePolicy)  # (declared with --schedule-policy)
PREFIX_AWARE = frozenset({"lpm", "dfs-weight", "shortest-prefill-first"})

MatchFn = Callable[[Request], tuple[TreeNode, int]]  # -> (node, cached length)


class FairShare:
    """When admission last served each client (the most recent clients only: one that
    has not been seen for a while counts as never served, which only puts it first)."""

    def __init__(self, remember: int = 4096) -> None:
        self._served: OrderedDict[bytes, int] = OrderedDict()
        self._tick = 0
        self._remember = remember

    def admitted(self, client: bytes) -> None:
        self._tick += 1
        self._served[client] = self._tick
        self._served.move_to_end(client)
        if len(self._served) > self._remember:
            self._served.popitem(last=False)

    def last(self, client: bytes) -> int:
        return self._served.get(client, 0)


# The program policy's defaults (--program-starve, --program-quantum: runtime/config.py).
# A level boundary makes the programs below it catch up with the ones above before these
# go on, so programs of about one size progress together and finish together, late; the
# first level is therefore a whole typical agent program (tens of turns of tool output),
# and the levels separate programs of really different sizes.
STARVE_S = 60.0
QUANTUM = 16384
LEVELS = 12  # levels beyond the first double up to QUANTUM * 2**10, then one


class Programs:
    """Each program's attained service (tokens computed for it) and arrival (its first
    request's), and since when each waiting request has waited: what the ``program``
    policy orders by. Bounded: the least recently served programs beyond `remember` are
    forgotten (counted as new)."""

    def __init__(self, starve_s: float = STARVE_S, clock: Callable[[], float] = time.monotonic,
                 remember: int = 65536, quantum: int = QUANTUM, levels: int = LEVELS) -> None:
        if quantum < 1 or levels < 1:
            raise ValueError(f"quantum ({quantum}) and levels ({levels}) must be >= 1")
        self.starve_s = starve_s
        self.clock = clock
        self.quantum = quantum
        self.levels = levels
        self._service: OrderedDict[str, int] = OrderedDict()
        self._born: dict[str, int] = {}  # a served program -> its first request's arrival
        self._since: dict[int, float] = {}  # a waiting request's arrival -> first seen waiting
        self._ranks: dict[int, tuple[int, int, int]] = {}  # the queue's, as last ordered
        self._remember = remember

    @staticmethod
    def of(r: Request) -> str:
        g = r.group
        return g.program if g.program is not None else f"request:{g.key}"

    def charge(self, plan: Sequence[Scheduled]) -> None:
        """Service of one step: each scheduled request's new tokens, to its program."""
        service = self._service
        for s in plan:
            p = self.of(s.req)
            service[p] = service.get(p, 0) + s.extend
            service.move_to_end(p)
            self._born[p] = min(self._born.get(p, s.req.arrival), s.req.arrival)
        while len(service) > self._remember:
            self._born.pop(service.popitem(last=False)[0], None)

    def attained(self, program: str) -> int:
        return self._service.get(program, 0)

    def level(self, program: str) -> int:
        """0 below `quantum` tokens of service, then k for [quantum * 2**(k-1),
        quantum * 2**k), capped at `levels` - 1."""
        doublings = self.attained(program) // self.quantum
        return min(self.levels - 1, doublings.bit_length())

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        """`waiting` by priority, then by level (0 for a request that has waited
        `starve_s`), then by program arrival, then arrival. A request has waited since the
        engine took it in (`GroupTimes.queued`, on this clock), else since this first saw
        it."""
        now = self.clock()
        since = {r.arrival: self._since.get(r.arrival, _queued(r, now)) for r in waiting}
        self._since = since  # (admitted and aborted requests leave it here)
        born: dict[str, int] = {}  # each waiting program's arrival
        for r in waiting:  # (one not yet served arrived with its oldest waiting request)
            p = self.of(r)
            served = self._born.get(p)
            born[p] = served if served is not None else min(born.get(p, r.arrival), r.arrival)
        ranks = {}
        for r in waiting:
            p = self.of(r)
            level = 0 if now - since[r.arrival] >= self.starve_s else self.level(p)
            ranks[r.arrival] = (-r.group.priority, level, born[p])
        self._ranks = ranks
        return sorted(waiting, key=lambda r: (ranks[r.arrival], r.arrival))

    def rank(self, r: Request) -> tuple[int, int, int]:
        """Where `r`'s program stands (lower goes first): priority, level, program arrival;
        for a request in the queue as last ordered, its level 0 if it had waited
        `starve_s`; for an admitted one, its program's level."""
        if r.state is ReqState.WAITING and r.arrival in self._ranks:
            return self._ranks[r.arrival]
        p = self.of(r)
        return (-r.group.priority, self.level(p), self._born.get(p, r.arrival))


def _queued(r: Request, now: float) -> float:
    times = getattr(r.group, "times", None)
    return times.queued if times is not None else now


def fair_victims(running: Sequence[Request], waiting: Sequence[Request],
                 max_running: int) -> list[Request]:
    """Running requests to retract so that waiting clients below their fair share of the
    `max_running` slots get one each (newest first from the clients furthest above their
    share; none while slots are free or every client is within its share)."""
    free = max_running - len(running)
    if not waiting:
        return []
    held: dict[bytes, list[Request]] = defaultdict(list)
    for r in running:
        held[r.group.client].append(r)
    queued: dict[bytes, int] = defaultdict(int)
    for r in waiting:
        queued[r.group.client] += 1
    clients = set(held) | set(queued)
    if len(clients) < 2:
        return []
    share = max(1, max_running // len(clients))
    want = sum(min(n, share - len(held.get(c, ()))) for c, n in queued.items()
               if len(held.get(c, ())) < share)
    victims: list[Request] = []
    while want > free + len(victims) and held:
        c = max(held, key=lambda k: (len(held[k]), held[k][-1].arrival))  # (never empty)
        if len(held[c]) <= share:
            break
        victims.append(held[c].pop())  # running is in admission order: the newest last
    return victims


def order_waiting(
    policy: str, waiting: Sequence[Request], match: MatchFn, max_matched: int = 128,
    fair: FairShare | None = None, programs: Programs | None = None,
) -> list[Request]:
    """`waiting` in the order admission should try them."""
    if policy == "program":
        order = (programs or Programs()).order(waiting)
    else:
        order = _policy_order(policy, waiting, match, max_matched)
    return round_robin(order, fair or FairShare())


def round_robin(order: list[Request], fair: FairShare) -> list[Request]:
    """`order` with each priority level interleaved by client: every client's first
    request (in `order`), then every client's second, and so on; within a round, the
    client served least recently first."""
    if len(order) <= 1:
        return order
    seen: dict[tuple[int, bytes], int] = defaultdict(int)
    rank = {}
    for r in order:
        level = (r.group.priority, r.group.client)
        rank[id(r)] = seen[level]
        seen[level] += 1
    if len({client for _, client in seen}) == 1:
        return order
    return sorted(order, key=lambda r: (-r.group.priority, rank[id(r)], fair.last(r.group.client)))


def _policy_order(
    policy: str, waiting: Sequence[Request], match: MatchFn, max_matched: int
) -> list[Request]:
    if policy == "fcfs" or len(waiting) > max_matched or len(waiting) <= 1:
        return sorted(waiting, key=_fcfs_key)
    matched = {id(r): match(r) for r in waiting}
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-r.group.priority, -matched[id(r)][1], r.arrival))
    if policy == "shortest-prefill-first":
        return sorted(
            waiting,
            key=lambda r: (-r.group.priority, r.num_tokens - matched[id(r)][1], r.arrival),
        )
    if policy == "dfs-weight":
        order = _dfs_weight(waiting, {k: v[0] for k, v in matched.items()})
        return sorted(order, key=lambda r: -r.group.priority)  # stable: keeps DFS order
    raise ValueError(f"unknown schedule policy {policy!r}")


def _fcfs_key(r: Request) -> tuple[int, int]:
    return (-r.group.priority, r.arrival)


def _dfs_weight(waiting: Sequence[Request], nodes: dict[int, TreeNode]) -> list[Request]:
    """SGLang's dfs-weight: a node's weight is the number of waiting requests whose match
    ends in its subtree; walk the tree depth-first, heaviest child first, emitting each
    node's requests (in arrival order) after those of its subtree."""
    at: dict[int, list[Request]] = defaultdict(list)
    node_of: dict[int, TreeNode] = {}
    for r in sorted(waiting, key=lambda r: r.arrival):
        node = nodes[id(r)]
        at[id(node)].append(r)
        node_of[id(node)] = node
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, list[TreeNode]] = defaultdict(list)
    roots: list[TreeNode] = []
    for nid, reqs in at.items():
        node: TreeNode | None = node_of[nid]
        while node is not None:  # every ancestor's subtree holds these requests
            key = id(node)
            if key not in weight:
                node_of[key] = node
                parent = node.parent
                (roots if parent is None else children[id(parent)]).append(node)
            weight[key] += len(reqs)
            node = node.parent
    out: list[Request] = []
    # Post-order, heaviest child first: a node's own requests go after its subtree's, so
    # requests with the longest cached prefix in the heaviest subtree run first.
    stack: list[tuple[TreeNode, bool]] = [(n, False) for n in sorted(roots, key=_by(weight))]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(at.get(id(node), ()))
            continue
        stack.append((node, True))
        # Pushed lightest first, so the heaviest child is popped (visited) next.
        stack.extend((c, False) for c in sorted(children.get(id(node), ()), key=_by(weight)))
    return out


def _by(weight: dict[int, int]) -> Callable[[TreeNode], int]:
    return lambda n: weight[id(n)]


def held_back(
    cand: Request, cached_len: int, inflight: Sequence[Request], min_shared: int, page_size: int
) -> bool:
    """In-batch prefix dedup (SGLang's in-batch prefix caching check): hold `cand` while a
    request still prefilling shares with it at least `min_shared` tokens that were not
    cached when that request started, until it has inserted them; `cand` then hits them
    instead of computing them a second time. A branch of an n > 1 request waits for
    branch 0's prefill."""
    dep = cand.after
    if dep is not None and not dep.group.prefilled and dep.state not in TERMINAL:
        return True
    ns = cand.group.namespace
    limit = cand.num_tokens - 1
    for f in inflight:
        if f is cand or f.group.namespace != ns or f.tree_len >= limit:
            continue
        n = min(limit, f.num_tokens)
        if n <= cached_len or f.tokens[cached_len] != cand.tokens[cached_len]:
            continue  # nothing beyond what `cand` already hits
        shared = common_prefix_len(cand.tokens[:n], f.tokens[:n])
        shared = align_down(shared, page_size)
        # `f` found max(f.cached_tokens, 0) cached when admitted: the rest of the shared
        # prefix is new work it is doing, worth waiting for once it is long enough.
        if shared - max(f.cached_tokens, 0) >= min_shared and f.tree_len < shared:
            return True
    return False
