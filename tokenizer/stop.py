"""`StopStringMatcher`: find stop strings in streamed text without emitting past them.

Semantics (the reference the tests check against): the hit is the occurrence that is
*complete first* in the text, i.e. the one with the smallest end position; if several stop
strings end there, the longest (earliest-starting) one. The emitted text is everything
before that occurrence; the stop string itself is not emitted. This is the earliest point
at which a streaming engine can know it must stop, so generation never runs past it.

Between chunks the matcher holds back the longest suffix of the pending text that is a
proper prefix of some stop string (it may still become one); everything before it is
safe to emit. `flush` releases the held suffix when the stream ends without a hit.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Streaming stop-string search for one output stream."""

    def __init__(self, stops: Iterable[str]) -> None:
        unique = []
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if s not in unique:
                unique.append(s)
        self.stops: tuple[str, ...] = tuple(unique)
        self._max_len = max((len(s) for s in self.stops), default=0)
        # A suffix that may still grow into a stop string is a proper prefix of one: it
        # starts with a stop's first character and ends with a character of a stop's
        # proper prefix. Most streamed text ends otherwise and is released without a scan.
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._inner_chars = frozenset(c for s in self.stops for c in s[:-1])
        self._held = ""
        self.hit: str | None = None  # the stop string found, once found

    @property
    def done(self) -> bool:
        return self.hit is not None

    @property
    def held(self) -> str:
        """Text received but not emitted yet (a possible start of a stop string)."""
        return self._held

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add streamed text; return ``(emit, hit)``.

        `emit` is the text now safe to pass on; `hit` is the stop string found (then `emit`
        ends right before it and the matcher is done: later calls return ``("", None)``).
        """
        if self.hit is not None:
            return "", None
        if not self.stops:
            return text, None
        buf = self._held + text
        best_end = -1
        best: str | None = None
        for s in self.stops:
            i = buf.find(s)
            if i < 0:
                continue
            end = i + len(s)
            if best is None or end < best_end or (end == best_end and len(s) > len(best)):
                best_end, best = end, s
        if best is not None:
            self.hit = best
            self._held = ""
            return buf[: best_end - len(best)], best
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """End of stream: release the held text (it did not complete a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        if not buf or buf[-1] not in self._inner_chars:
            return 0
        first_chars = self._first_chars
        n = len(buf)
        for i in range(max(0, n - self._max_len + 1), n):  # longest suffix first
            if buf[i] in first_chars:
                k = n - i
                tail = buf[i:]
                if any(len(s) > k and s.startswith(tail) for s in self.stops):
                    return k
        return 0
