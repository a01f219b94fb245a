"""Rebuilding a session on another replica from its log (records.py).

The steps are protocol requests: the session's `open_session` as it was sent, then each
appended input and each produced run of tokens as a ``max_tokens=0`` turn (the replica's
frontend renders the input against the same history, so it gives the same ids; produced
tokens go in as ``input_ids``), and each cut as a `truncate_session`. They run one after
another (one turn per session at a time); what the replica computes for them is the
history's recomputation, which the session's next turn reports as ``recomputed_tokens``.
"""

from __future__ import annotations

from radixlm.runtime.protocol import (
    ClientMessage,
    Generate,
    Input,
    OpenSession,
    SamplingParams,
    TruncateSession,
)
from radixlm.runtime.router.records import Appended, Cut, LogEntry, Opened, Produced

__all__ = ["replay_steps"]

_APPEND_ONLY = SamplingParams(max_tokens=0)


def replay_steps(log: list[LogEntry]) -> tuple[OpenSession, list[ClientMessage]]:
    """The open request, then the requests that follow it (rid and session left for the
    caller: ``""``); consecutive produced runs are sent as one."""
    first = log[0]
    assert isinstance(first, Opened), "a session's log starts with its opening"
    steps: list[ClientMessage] = []
    ids: list[int] = []

    def flush_ids() -> None:
        if ids:
            steps.append(Generate(rid="", session="", input=Input(input_ids=list(ids)),
                                  sampling=_APPEND_ONLY))
            ids.clear()

    for entry in log[1:]:
        if isinstance(entry, Produced):
            ids.extend(entry.token_ids)
            continue
        flush_ids()
        if isinstance(entry, Appended):
            steps.append(Generate(rid="", session="", input=entry.input, tools=entry.tools,
                                  tool_choice="none", sampling=_APPEND_ONLY))
        elif isinstance(entry, Cut):
            steps.append(TruncateSession(rid="", session="", length=entry.length))
    flush_ids()
    return first.msg, steps
