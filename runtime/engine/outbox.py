"""What the engine sends the frontend: replies addressed to one client, and the token
outputs of each step (one `StepOutputs` per `take`), after the session notes that let
the frontend render the next appends to those sessions."""

from __future__ import annotations

from radixlm.runtime.engine.messages import (
    SessionNote,
    SessionNotes,
    StepOutputs,
    ToClient,
    ToFrontend,
    TokenOutput,
)
from radixlm.runtime.protocol import Struct, encode


class Outbox:
    def __init__(self) -> None:
        self.outputs: list[TokenOutput] = []  # appended to directly on the hot path
        self._notes: list[SessionNote] = []
        self._replies: list[ToFrontend] = []

    def reply(self, client: bytes, msg: Struct, ends: int | None = None) -> None:
        self._replies.append(ToClient(client=client, data=encode(msg), ends=ends))

    def note(self, note: SessionNote) -> None:
        self._notes.append(note)

    def take(self) -> list[ToFrontend]:
        """Session notes, replies so far, then one StepOutputs with every output since
        the last call."""
        out = self._replies
        if self._notes:
            out.insert(0, SessionNotes(notes=self._notes))
            self._notes = []
        if self.outputs:
            out.append(StepOutputs(outputs=self.outputs))
            self.outputs = []
        self._replies = []
        return out
