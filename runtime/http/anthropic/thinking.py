"""A reasoning model's ``<think>...</think>`` block, split from its answer as it streams:
the same split as the SDK's `rl.separate_reasoning` (`radixlm.sdk.reasoning`), made
incrementally, so that thinking streams as ``thinking_delta`` and the answer as
``text_delta``.

- *Opened*: an output that starts (after whitespace) with the opening tag thinks until
  the closing tag; one that does not is all text (a tag later on is text too). *Forced* (`forced=True`: the prompt's generation header already opened
  the block, as DeepSeek-R1's and some Qwen3 templates do): the output thinks from its
  first token (an opening tag it writes anyway is dropped).
- Whitespace right after the closing tag is dropped (the answer starts at its first
  visible character); an output that ends while thinking is all thinking.
- Only what may be the start of a tag is held back between chunks.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
THINKING, TEXT = "thinking", "text"
Piece = tuple[str, str]  # (THINKING or TEXT, its text)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ThinkingSplitter:
    __slots__ = ("_state", "_held")

    def __init__(self, forced: bool = False) -> None:
        # start: undecided; lead: forced, before any (repeated) opening tag is ruled out;
        # think; gap: after the closing tag, dropping whitespace; text: pass-through.
        self._state = "lead" if forced else "start"
        self._held = ""

    @property
    def passing(self) -> bool:
        """Text goes straight through (no thinking block can start any more)."""
        return self._state == "text"

    def feed(self, text: str) -> list[Piece]:
        if self._state == "text":
            return [(TEXT, text)] if text else []
        self._held += text
        out: list[Piece] = []
        while True:
            state, held = self._state, self._held
            if state == "start":
                body = held.lstrip()
                if body.startswith(OPEN):
                    self._state, self._held = "think", body[len(OPEN):]
                elif not OPEN.startswith(body):  # (an empty body may still open)
                    self._state = "text"
                    self._held = ""
                    return [*out, (TEXT, held)]
                else:
                    return out
            elif state == "lead":
                if held.startswith(OPEN):
                    self._held = held[len(OPEN):]
                elif OPEN.startswith(held):
                    return out
                else:
                    self._state = "think"
            elif state == "think":
                at = held.find(CLOSE)
                if at < 0:
                    keep = _partial_tail(held, CLOSE)
                    if len(held) > keep:
                        out.append((THINKING, held[: len(held) - keep]))
                        self._held = held[len(held) - keep:]
                    return out
                if at:
                    out.append((THINKING, held[:at]))
                self._state, self._held = "gap", held[at + len(CLOSE):]
            elif state == "gap":
                body = held.lstrip()
                self._held = ""
                if not body:
                    return out
                self._state = "text"
                return [*out, (TEXT, body)]
            else:
                return out

    def finish(self) -> list[Piece]:
        """What was held back, once the output ended (or a call began)."""
        state, held = self._state, self._held
        self._held = ""
        self._state = "text"
        if not held:
            return []
        if state == "start":
            return [(TEXT, held)]
        if state == "think" or (state == "lead" and not OPEN.startswith(held)):
            return [(THINKING, held)]
        return []
