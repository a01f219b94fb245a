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
that has stop strings or stop_regex patterns): it maps the text back to tokens, so the
engine holds back only the tokens that may begin a stop string and ends the branch at the
kept tokens. A stop_regex pattern (tokenizer/stop_regex.py, SGLang's rules) ends the
branch at the first token after which the output's text matches it; the text is cut only
where the pattern's characters occur literally (as SGLang trims), else all of it is kept.
So that nothing past such a cut is ever sent, text that is, or may grow into, a literal
occurrence of a pattern is held back as a possible stop string is (until the end, once
one is complete without the regex matching: a later match would cut there).
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from radixlm.tokenizer.call_parser import CallEnd, CallParser
from radixlm.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.tokenizer.stop_regex import StopRegex

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

    def add(self, stop: str) -> None:
        """One more stop string, matched in the text fed from now on."""
        if not stop or stop in self.stops:
            return
        self.stops += (stop,)
        self._max_len = max(self._max_len, len(stop))
        self._first_chars = self._first_chars | {stop[0]}
        self._inner_chars = self._inner_chars | set(stop[:-1])

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
    """Stop strings (and stop_regex patterns) over one stream of token ids (one output
    branch): the engine's matcher.

    Tokens are detokenized incrementally (`IncrementalDetokenizer`, with `context`: the
    tail of the prompt, as the frontend's detokenizer has it) and their text searched by a
    `StopStringMatcher`. Only tokens whose text may still begin a stop string (or that
    end inside a character) are held back: `released` counts the leading tokens whose
    text has been emitted in full, which may be passed on.

    When a stop string matches (`hit`), the branch keeps the shortest token prefix whose
    text covers everything before it (`kept`; tokens completing one character stay
    together), so the history a session keeps is exactly the returned text whenever the
    stop string starts at a token boundary; otherwise the last kept token also holds the
    stop string's first `trim` characters, which the text leaves out. A regex hit keeps
    every token up to the one that completed the match, unless the pattern occurs
    literally in the text: then it is cut there as a stop string is.

    With `calls` (a `CallParser` over the output's parallel tool calls), each call, once
    complete, becomes a stop string of the text after it: a call that repeats an earlier
    one word for word ends the branch before it (`repeated`), and while a call may still
    become a repeat its tokens are held back. The branch then keeps only the tokens whose
    text ends before the repeat (no `trim`): its history ends with the last new call.
    """

    __slots__ = ("_detok", "_stops", "_regex", "_literal", "_text", "_ends", "_decoded",
                 "_emitted", "_safe", "_hit", "_calls", "_call_stops", "released", "kept",
                 "trim", "finished")

    def __init__(self, tokenizer: Any, stops: Iterable[str], context: Sequence[int] = (),
                 regexes: Sequence[str] = (), calls: CallParser | None = None) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=context)
        self._stops = StopStringMatcher(stops)
        self._calls = calls
        self._call_stops: set[str] = set()  # the calls so far, as stop strings
        self._regex = StopRegex(regexes) if regexes else None
        # The patterns as literal strings: what may still be cut away is held back.
        self._literal = StopStringMatcher(regexes)
        self._text = ""  # the output's text so far (kept only for stop_regex)
        self._safe = 0  # characters before any (possible) literal occurrence of a pattern
        self._hit: str | None = None
        self._ends: list[int] = []  # where each token's text ends (_PENDING while held)
        self._decoded = 0  # characters detokenized
        self._emitted = 0  # of those, passed by the string matcher (before any stop)
        self.released = 0  # leading tokens whose text is emitted in full
        self.kept: int | None = None  # with a hit: the tokens the branch keeps
        self.trim = 0  # with a hit: characters of the kept tokens' text past the stop's start
        self.finished = False  # the stream ended (`finish`)

    @property
    def hit(self) -> str | None:
        """The stop string (or stop_regex pattern) that matched, once one has."""
        return self._hit

    @property
    def repeated(self) -> bool:
        """The branch ended at a call that repeats an earlier one (not a stop the request
        gave)."""
        return self._hit is not None and self._hit in self._call_stops

    @property
    def matched(self) -> str | None:
        """The request's stop string or pattern that matched (None for a repeated call)."""
        return None if self.repeated else self._hit

    def feed(self, ids: Iterable[int]) -> bool:
        """Take the next generated tokens; True when a stop string has matched (the tokens
        after it are then ignored, as is everything fed later)."""
        if self._hit is not None or self.finished:
            return self._hit is not None
        detok, ends = self._detok, self._ends
        for token in ids:
            piece = detok.feed((token,))
            ends.append(_PENDING)
            if piece and self._take(piece):
                return True
        emitted = self._emitted if self._regex is None else min(self._emitted, self._safe)
        self.released = bisect_right(ends, emitted)
        return False

    def finish(self) -> bool:
        """The stream ends (EOS, length, grammar, abort): release the held text, which may
        still complete a stop string (True then)."""
        if self._hit is not None or self.finished:
            return self._hit is not None
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
        if self._calls is not None:
            start, base = 0, self._decoded - len(piece)
            for e in self._calls.feed(piece):  # (a complete call's text is no repeat of
                if type(e) is not CallEnd:  # itself: it stops only what follows it)
                    continue
                cut = e.end - base
                if self._take_text(piece[start:cut]):
                    return True
                if e.text not in self._stops.stops:
                    self._call_stops.add(e.text)
                    self._stops.add(e.text)
                start = cut
            piece = piece[start:]
        return self._take_text(piece)

    def _take_text(self, piece: str) -> bool:
        """Decoded text, searched for stop strings, calls' repeats and patterns."""
        emit, hit = self._stops.feed(piece) if piece else ("", None)
        self._emitted += len(emit)
        if hit is not None:
            self._hit = hit
            if hit in self._call_stops:  # a repeated call: the tokens wholly before it
                self.kept = self.released = bisect_right(self._ends, self._emitted)
                self.trim = 0
            else:
                self._keep_before(self._emitted)
            return True
        regex = self._regex
        if regex is None or not piece:
            return False
        self._text += piece
        self._safe += len(self._literal.feed(piece)[0])
        if not regex.search(self._text, len(piece)):
            return False
        self._hit = pattern = regex.hit
        assert pattern is not None
        cut = self._text.find(pattern)  # SGLang's trim: the pattern found literally
        if cut == -1:  # the match stays: every token so far is kept
            self.kept = self.released = len(self._ends)
            self.trim = 0
        else:
            self._keep_before(cut)
        return True

    def _keep_before(self, chars: int) -> None:
        """Keep the shortest token prefix whose text covers the first `chars` characters."""
        ends = self._ends
        kept = bisect_right(ends, ends[bisect_left(ends, chars)]) if chars else 0
        self.kept = self.released = kept
        self.trim = ends[kept - 1] - chars if kept else 0
