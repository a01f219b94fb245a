"""What the frontend remembers about each session's history, to render appends exactly.

The engine holds a session's tokens; the frontend only needs to know how the history
*ends* so that appended chat messages continue it token-exactly:

- `empty`: nothing yet (the first messages get a full render: default system prompt, BOS);
- `open_assistant`: the last turn rendered an assistant header (``add_generation_prompt``)
  and the model's reply follows it, so the turn has not been closed by the template's
  end-of-turn markup yet. Appending messages first appends that markup, minus the end
  token the model already produced (``<|im_end|>`` ends the output, ``\\n`` remains);
- `last_token`: the history's last token (to see whether the model emitted that end token).

The engine keeps each session's view with its history (it is told whether each input
leaves an assistant turn open, `assistant_flag`) and notes every change to the frontend
ahead of the reply that reports it (`SessionNote`); the tracker only applies those notes,
on the main thread. When the frontend cuts a finished turn at a stop string it fixes the
view's last token itself (`trimmed`), since the client may answer before the engine's note
of the cut arrives. A session the frontend has not seen (a bad id: the engine will refuse
it) is treated as a closed, non-empty history.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from radixlm.runtime.engine.messages import SessionNote
from radixlm.runtime.protocol import Input


@dataclass(frozen=True)
class SessionView:
    empty: bool
    open_assistant: bool = False
    last_token: int | None = None


UNKNOWN_HISTORY = SessionView(empty=False)
EMPTY_HISTORY = SessionView(empty=True)


def assistant_flag(inp: Input | None) -> bool | None:
    """Whether a history ends inside an assistant turn once `inp` is appended to it:
    messages end with the assistant header iff ``add_generation_prompt``; raw text or ids
    change nothing (None: they extend whatever turn is open)."""
    if inp is not None and inp.messages is not None:
        return inp.add_generation_prompt
    return None


def view_of(note: SessionNote) -> SessionView:
    return SessionView(empty=note.length == 0, open_assistant=note.assistant_open,
                       last_token=note.last_token)


class SessionTracker:
    """Session id -> (owner client, view), from the engine's notes. Main thread only."""

    def __init__(self) -> None:
        self._views: dict[str, SessionView] = {}
        self._owners: dict[str, bytes] = {}

    def view(self, session: str) -> SessionView:
        return self._views.get(session, UNKNOWN_HISTORY)

    def apply(self, note: SessionNote) -> None:
        if note.closed:
            self.forget(note.session)
        else:
            self._views[note.session] = view_of(note)
            self._owners[note.session] = note.client

    def trimmed(self, session: str, last_token: int | None) -> None:
        """The frontend cut the session's last turn: its history now ends at `last_token`."""
        view = self._views.get(session)
        if view is not None:
            self._views[session] = replace(view, last_token=last_token)

    def forget(self, session: str) -> None:
        self._views.pop(session, None)
        self._owners.pop(session, None)

    def forget_client(self, client: bytes) -> None:
        """The client is gone: the engine closes its sessions."""
        for session in [s for s, owner in self._owners.items() if owner == client]:
            self.forget(session)

    def __len__(self) -> int:
        return len(self._views)
