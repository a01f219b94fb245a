"""What the frontend remembers about each session's history, to render appends exactly.

The engine holds a session's tokens; the frontend only needs to know how the history
*ends* so that appended chat messages continue it token-exactly:

- `empty`: nothing yet (the first messages get a full render: default system prompt, BOS);
- `open_assistant`: the last turn rendered an assistant header (``add_generation_prompt``)
  and the model's reply follows it, so the turn has not been closed by the template's
  end-of-turn markup yet. Appending messages first appends that markup, minus the end
  token the model already produced (``<|im_end|>`` ends the output, ``\\n`` remains);
- `last_token`: the history's last token (to see whether the model emitted that end token).

Views change only as replies pass through the frontend (SessionOpened, Done.session,
SessionsForked, the Ok of a truncate), on the main thread. A session the frontend has not
seen (a bad id: the engine will refuse it) is treated as a closed, non-empty history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.runtime.protocol import Input


@dataclass(frozen=True)
class SessionView:
    empty: bool
    open_assistant: bool = False
    last_token: int | None = None


UNKNOWN_HISTORY = SessionView(empty=False)
EMPTY_HISTORY = SessionView(empty=True)


def opens_assistant(inp: Input | None, before: bool) -> bool:
    """Whether a history ends inside an assistant turn after `inp` is appended to it.

    Messages end with the assistant header iff ``add_generation_prompt``; raw text or ids
    change nothing (they extend whatever turn is open)."""
    if inp is not None and inp.messages is not None:
        return inp.add_generation_prompt
    return before


def after_append(before: SessionView, inp: Input | None, appended: Sequence[int],
                 output: Sequence[int] = ()) -> SessionView:
    """The view once `appended` (the input's tokens) and then `output` joined the history."""
    tail = output or appended
    last = tail[-1] if tail else before.last_token
    return SessionView(
        empty=before.empty and not appended and not output,
        open_assistant=opens_assistant(inp, before.open_assistant),
        last_token=last,
    )


class SessionTracker:
    """Session id -> (owner client, view). Main thread only."""

    def __init__(self) -> None:
        self._views: dict[str, SessionView] = {}
        self._owners: dict[str, bytes] = {}

    def view(self, session: str) -> SessionView:
        return self._views.get(session, UNKNOWN_HISTORY)

    def set(self, session: str, owner: bytes, view: SessionView) -> None:
        self._views[session] = view
        self._owners[session] = owner

    def forget(self, session: str) -> None:
        self._views.pop(session, None)
        self._owners.pop(session, None)

    def forget_client(self, client: bytes) -> None:
        """The client is gone: the engine closes its sessions."""
        for session in [s for s, owner in self._owners.items() if owner == client]:
            self.forget(session)

    def __len__(self) -> int:
        return len(self._views)
