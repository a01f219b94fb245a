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
  programs of their own. Anti-starvation (Autellix's rule): a request that has waited
  `starve_s` goes before every request that has not, oldest first -- so, within its
  priority and client, a request is admitted at the first admission after it has waited
  `starve_s` that does not go to a request that arrived before it.

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
from radixlm.runtime.engine.state import TERMINAL

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


STARVE_S = 10.0  # the program policy's anti-starvation wait (seconds)
# The program policy's first level: programs served less than one scheduler step's prompt
# budget (the default --chunked-prefill, 2048 tokens). Finer differences cannot change
# how admission fills a step, and a program's first turn (system prompt, tools, task)
# mostly fits in it, so every program starts level with every other new one.
QUANTUM = 2048
LEVELS = 12  # levels beyond the first double up to 2048 * 2**10 (~2M tokens), then one


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
        """`waiting` by priority, then the starved (waited `starve_s`) oldest first, then
        by level, then by program arrival, then arrival. A request has waited since the
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

        def key(r: Request) -> tuple[int, int, float, int, int]:
            waited = since[r.arrival]
            if now - waited >= self.starve_s:
                return (-r.group.priority, 0, waited, 0, r.arrival)
            p = self.of(r)
            return (-r.group.priority, 1, self.level(p), born[p], r.arrival)

        return sorted(waiting, key=key)


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
