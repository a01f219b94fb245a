"""What the engine sends the frontend: replies addressed to one client, and the token
outputs of each step (one `StepOutputs` per `take`, after the replies)."""

from __future__ import annotations

from radixlm.runtime.engine.wire import StepOutputs, ToClient, ToFrontend, TokenOutput
from radixlm.runtime.protocol import Struct, encode


class Outbox:
    def __init__(self) -> None:
        self.outputs: list[TokenOutput] = []  # appended to directly on the hot path
        self._replies: list[ToFrontend] = []

    def reply(self, client: bytes, msg: Struct, ends: int | None = None) -> None:
        if not client:  # the engine's own requests (pins restored at start): nobody waits
            return
        self._replies.append(ToClient(client=client, data=encode(msg), ends=ends))

    def send(self, msg: ToFrontend) -> None:
        """A message for the frontend itself (its `EngineReady`, again), in order."""
        self._replies.append(msg)

    def take(self) -> list[ToFrontend]:
        """Replies so far, then one StepOutputs with every output since the last call."""
        out = self._replies
        if self.outputs:
            out.append(StepOutputs(outputs=self.outputs))
            self.outputs = []
        self._replies = []
        return out
