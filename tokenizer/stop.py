"""`StopStringMatcher`: find stop strings in streamed text without emitting past them.

Semantics (the reference the tests check against): the hit is the occurrence that is
*complete first* in the text, i.e. the one with the smallest end position; if several stop
strings end there, the longest (earliest-starting) one. The emitted text is everything
before that occurrence; the stop string itself is not emitted. This is the earliest point
at which a streaming engine can know it must stop, so generation never runs past it.

Between chunks the matcher holds back the longest suffix of the pending text that is a
proper prefix of some stop string (it may still become one); everything before it is
safe to emit. `flush` releases the held suffix when the stream ends without a hit.

`TokenStopMatcher` applies it to a stream of token ids (the engine runs one per branch
that has stop strings): it maps the text back to tokens, so the engine holds back only
the tokens that may begin a stop string and ends the branch at the kept tokens.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from radixlm.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["StopStringMatcher", "TokenStopMatcher"]


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


_PENDING = sys.maxsize  # the text end of a token the detokenizer still holds back


class TokenStopMatcher:
    """Stop strings over one stream of token ids (one output branch): the engine's matcher.

    Tokens are detokenized incrementally (`IncrementalDetokenizer`, with `context`: the
    tail of the prompt, as the frontend's detokenizer has it) and their text searched by a
    `StopStringMatcher`. Only tokens whose text may still begin a stop string (or that
    end inside a character) are held back: `released` counts the leading tokens whose
    text has been emitted in full, which may be passed on.

    When a stop string matches (`hit`), the branch keeps the shortest token prefix whose
    text covers everything before it (`kept`; tokens completing one character stay
    together), so the history a session keeps is exactly the returned text whenever the
    stop string starts at a token boundary; otherwise the last kept token also holds the
    stop string's first `trim` characters, which the text leaves out.
    """

    __slots__ = ("_detok", "_stops", "_ends", "_decoded", "_emitted", "released", "kept",
                 "trim", "finished")

    def __init__(self, tokenizer: Any, stops: Iterable[str], context: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=context)
        self._stops = StopStringMatcher(stops)
        self._ends: list[int] = []  # where each token's text ends (_PENDING while held)
        self._decoded = 0  # characters detokenized
        self._emitted = 0  # of those, passed by the string matcher (before any stop)
        self.released = 0  # leading tokens whose text is emitted in full
        self.kept: int | None = None  # with a hit: the tokens the branch keeps
        self.trim = 0  # with a hit: characters of the kept tokens' text past the stop's start
        self.finished = False  # the stream ended (`finish`)

    @property
    def hit(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._stops.hit

    def feed(self, ids: Iterable[int]) -> bool:
        """Take the next generated tokens; True when a stop string has matched (the tokens
        after it are then ignored, as is everything fed later)."""
        if self._stops.hit is not None or self.finished:
            return self._stops.hit is not None
        detok, ends = self._detok, self._ends
        for token in ids:
            piece = detok.feed((token,))
            ends.append(_PENDING)
            if piece and self._take(piece):
                return True
        self.released = bisect_right(ends, self._emitted)
        return False

    def finish(self) -> bool:
        """The stream ends (EOS, length, grammar, abort): release the held text, which may
        still complete a stop string (True then)."""
        if self._stops.hit is not None or self.finished:
            return self._stops.hit is not None
        self.finished = True
        piece = self._detok.flush()
        if self._take(piece):
            return True
        self._stops.flush()
        self.released = len(self._ends)
        return False

    def _take(self, piece: str) -> bool:
        """Text the detokenizer produced: the tokens it was holding back end with it."""
        self._decoded += len(piece)
        ends, i = self._ends, len(self._ends) - 1
        while i >= 0 and ends[i] == _PENDING:
            ends[i] = self._decoded
            i -= 1
        emit, hit = self._stops.feed(piece) if piece else ("", None)
        self._emitted += len(emit)
        if hit is None:
            return False
        emitted = self._emitted
        # The shortest token prefix whose text covers everything before the stop string.
        kept = bisect_right(ends, ends[bisect_left(ends, emitted)]) if emitted else 0
        self.kept = self.released = kept
        self.trim = ends[kept - 1] - emitted if kept else 0
        return True
