"""`TextBuffer`: a state's accumulated text, appended in O(1) and joined only when read.

``text += piece`` on an attribute copies the whole text every time (CPython's in-place
concatenation does not apply to attributes): O(n^2) over a long program. Pieces are
kept instead, and joined (once, then cached) when the text is read.
"""

from __future__ import annotations

__all__ = ["TextBuffer"]


class TextBuffer:
    __slots__ = ("_joined", "_pieces", "length")

    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = [text] if text else []
        self._joined: str | None = text
        self.length = len(text)

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
            self._joined = None

    def __len__(self) -> int:
        return self.length

    def __str__(self) -> str:
        joined = self._joined
        if joined is None:
            joined = self._joined = "".join(self._pieces)
            self._pieces = [joined]
        return joined

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters."""
        if length < self.length:
            self._joined = str(self)[:length]
            self._pieces = [self._joined]
            self.length = length

    def since(self, start: int) -> str:
        """The text from character `start` on."""
        return str(self)[start:]

    def copy(self) -> TextBuffer:
        return TextBuffer(str(self))
