"""How many decode rows a step may take while several clients are decoding.

A decode step's time grows with its rows (on a CPU steeply: SmolLM2 Q4_1, 2 threads,
measured ~10 ms at 1 row, ~45 at 8, ~200 at 64), and every request in the step waits for
all of it. So when one client floods the engine, another client's request, running in
the same batch, would get its tokens many times slower than alone. While requests of two
or more clients run, `StepBudget` caps a step at the most rows whose time, estimated
from the steps measured so far, stays within `factor` times a one-row step; the rows are
shared out round-robin across clients (each client's least recently stepped first), so
the light client's request is in every step and the flood's requests take turns with
the rest. A client stays active for ACTIVE_WINDOW_S after its last request, so one that
sends requests one after another does not meet a whole-batch step each time it returns.
One client alone, or a factor of 0, keeps whole batches (throughput first).

Estimates: an exponential average of the model's forward time for decode-only steps of
each row count; a row count not measured yet is interpolated between the nearest measured
ones (extrapolated from the largest, per row), and refined once it runs. Until a one-row
step has been timed there is no bound to hold: no cap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from radixlm.runtime.engine.request import Request

ALPHA = 0.25  # weight of a new measurement in the averages
# A client counts as active this long after its last request left: one that sends its
# requests one after another (an agent's turns) must not find a whole-batch step in the
# way each time it comes back.
ACTIVE_WINDOW_S = 2.0


class StepBudget:
    def __init__(self, factor: float, max_rows: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.factor = factor
        self.clock = clock
        self._seen: dict[bytes, float] = {}  # client -> when it last had a request here
        self.times: list[float | None] = [None] * (max_rows + 1)  # by decode rows
        self._stepped: dict[int, int] = {}  # id(request) -> the step it last decoded in
        self._step = 0
        self.capped_steps = 0  # steps that left decode rows out (stats, tests)

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only forward of `rows` rows took `seconds`."""
        if not 0 < rows < len(self.times):
            return
        old = self.times[rows]
        self.times[rows] = seconds if old is None else old + ALPHA * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        t = self.times
        if t[rows] is not None:
            return t[rows]
        lo = next((n for n in range(rows - 1, 0, -1) if t[n] is not None), None)
        hi = next((n for n in range(rows + 1, len(t)) if t[n] is not None), None)
        if lo is None:
            return None
        tl = t[lo]
        assert tl is not None
        if hi is not None:
            th = t[hi]
            assert th is not None
            return tl + (th - tl) * (rows - lo) / (hi - lo)
        t1 = t[1]
        per_row = (tl - t1) / (lo - 1) if lo > 1 and t1 is not None else 0.0
        return tl + max(per_row, 0.0) * (rows - lo)

    def cap(self, rows: int) -> int:
        """Rows a step of `rows` candidate rows may take (all of them when uncapped)."""
        t1 = self.times[1]
        if self.factor <= 0 or t1 is None or rows <= 1:
            return rows
        limit = self.factor * t1
        best = 1
        for n in range(2, min(rows, len(self.times) - 1) + 1):
            est = self.estimate(n)
            if est is None or est > limit:
                break
            best = n
        return best

    def select(self, decoding: Sequence[Request], others: Sequence[Request] = ()) -> list[Request]:
        """The rows to decode this step, in their running order; `others`: the requests
        running or waiting besides (a client whose request waits or prefills is active
        too: its request joins this step's batch or the next)."""
        self._step += 1
        clients: dict[bytes, list[Request]] = defaultdict(list)
        for r in decoding:
            clients[r.group.client].append(r)
        now = self.clock()
        for r in others:
            self._seen[r.group.client] = now
        for c in clients:
            self._seen[c] = now
        if len(self._seen) > 1:
            self._seen = {c: t for c, t in self._seen.items() if now - t <= ACTIVE_WINDOW_S}
        n = len(decoding) if len(self._seen) < 2 else self.cap(len(decoding))
        chosen = list(decoding) if n >= len(decoding) else self._round_robin(clients, n)
        for r in chosen:
            self._stepped[id(r)] = self._step
        if len(self._stepped) > 4 * len(decoding) + 64:  # forget requests that have left
            live = {id(r) for r in decoding}
            self._stepped = {k: v for k, v in self._stepped.items() if k in live}
        if len(chosen) == len(decoding):
            return chosen
        self.capped_steps += 1
        order = {id(r): i for i, r in enumerate(decoding)}
        return sorted(chosen, key=lambda r: order[id(r)])

    def _round_robin(self, clients: dict[bytes, list[Request]], n: int) -> list[Request]:
        queues = [sorted(rs, key=lambda r: self._stepped.get(id(r), 0)) for rs in clients.values()]
        # A tail row (a finished turn's last KV) costs one row and ends its request: first.
        chosen = [r for q in queues for r in q if r.pending_end is not None][:n]
        taken = {id(r) for r in chosen}
        queues = [[r for r in q if id(r) not in taken] for q in queues]
        # The clients stepped least recently first, one row each per round.
        queues.sort(key=lambda q: self._stepped.get(id(q[0]), 0) if q else 0)
        while len(chosen) < n and any(queues):
            for q in queues:
                if q and len(chosen) < n:
                    chosen.append(q.pop(0))
        return chosen
