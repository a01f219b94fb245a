"""The request table's queues against the states its moves make (`RequestTable.move`)."""

from __future__ import annotations

import numpy as np
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.table import RequestTable
from radixlm.runtime.protocol import SamplingParams


def _group(key: int) -> RequestGroup:
    g = RequestGroup(key=key, kind=RequestKind.GENERATE, client=b"c", rid=f"r{key}",
                     prompt=np.arange(4, dtype=np.int64), sampling=SamplingParams(max_tokens=2))
    g.branches.append(Request.new(g, 0, arrival=key, page_size=1))
    return g


def test_a_waiting_request_aborted_after_another_was_admitted_leaves_the_queue() -> None:
    """Admitting one request and aborting another that still waits, in the same step: the
    aborted one leaves the waiting queue (it once raised ValueError, list.remove, which the
    engine answered INTERNAL: seen by the fuzz test in CI)."""
    table = RequestTable()
    a, b, c = _group(1), _group(2), _group(3)
    for g in (a, b, c):
        table.add(g)
    table.move(a.branches[0], ReqState.PREFILLING)  # admitted
    table.move(b.branches[0], ReqState.ABORTED)  # still waiting, aborted
    assert list(table.running) == [a.branches[0]]
    assert list(table.waiting) == [c.branches[0]]
    table.move(c.branches[0], ReqState.ABORTED)
    assert list(table.waiting) == []
