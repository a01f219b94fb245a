"""`StopRegex`: the ``stop_regex`` patterns of one output, checked as its text grows.

Semantics (SGLang's): the output ends at the first token after which the text so far
matches one of the patterns (``re.search``); the matched pattern is reported. The text is
then trimmed where the pattern's own characters first occur *literally* in it (SGLang's
detokenizer looks the pattern up with ``str.find``), so a literal pattern trims like a
stop string and the match of a real regex stays in the text.

Patterns run inside the engine's loop, so `check_patterns` admits only those that cannot
take exponential time: at most `MAX_STOP_REGEX` patterns of at most `MAX_STOP_REGEX_LEN`
bytes (SGLang's limits), no backreferences, and no repetition nested in a repetition
(``(a+)+``). A pattern whose matches are at most `window` characters long is searched
only over the text where a match could end at the newest characters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

try:  # Python 3.11+: the parser is private; same module, new name
    import re._parser as sre_parse  # type: ignore[import-not-found]
    from re._constants import MAXREPEAT  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]
    from sre_constants import MAXREPEAT  # type: ignore[no-redef]

__all__ = ["MAX_STOP_REGEX", "MAX_STOP_REGEX_LEN", "StopRegex", "check_patterns"]

MAX_STOP_REGEX = 32
MAX_STOP_REGEX_LEN = 256  # bytes of UTF-8
_UNBOUNDED = -1
_REPEATS = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT,
            getattr(sre_parse, "POSSESSIVE_REPEAT", sre_parse.MAX_REPEAT)}


def _max_length(items: sre_parse.SubPattern, in_repeat: bool) -> int:
    """The longest match of a parsed pattern (`_UNBOUNDED` if there is no bound); raises
    ValueError for the shapes `check_patterns` refuses."""
    total = 0
    for op, value in items:
        if op in (sre_parse.LITERAL, sre_parse.NOT_LITERAL, sre_parse.IN, sre_parse.ANY,
                  sre_parse.CATEGORY):
            n = 1
        elif op == sre_parse.AT:  # ^, $, \b: zero width
            n = 0
        elif op == sre_parse.SUBPATTERN:
            n = _max_length(value[-1], in_repeat)
        elif op == sre_parse.BRANCH:
            lengths = [_max_length(b, in_repeat) for b in value[1]]
            n = _UNBOUNDED if _UNBOUNDED in lengths else max(lengths)
        elif op in _REPEATS:
            _, high, body = value
            repeats = high == MAXREPEAT or high > 1  # `?` is no repetition
            if repeats and in_repeat:
                raise ValueError("a repetition inside a repetition, such as (a+)+, can take "
                                 "exponential time")
            inner = _max_length(body, in_repeat or repeats)
            n = _UNBOUNDED if high == MAXREPEAT or inner == _UNBOUNDED else high * inner
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):  # lookarounds: zero width
            _max_length(value[1], in_repeat)
            n = 0
        elif op in (sre_parse.GROUPREF, sre_parse.GROUPREF_EXISTS):
            raise ValueError("backreferences are not allowed")
        else:  # anything else: no bound assumed
            n = _UNBOUNDED
        total = _UNBOUNDED if _UNBOUNDED in (n, total) else total + n
    return total


def check_patterns(patterns: Sequence[str]) -> str | None:
    """A clear message for the first stop_regex pattern that is refused, or None."""
    if len(patterns) > MAX_STOP_REGEX:
        return f"at most {MAX_STOP_REGEX} stop_regex patterns are allowed, got {len(patterns)}"
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            return f"stop_regex patterns must be non-empty strings, got {pattern!r}"
        if len(pattern.encode()) > MAX_STOP_REGEX_LEN:
            return f"a stop_regex pattern is at most {MAX_STOP_REGEX_LEN} bytes, got {pattern!r}"
        try:
            re.compile(pattern)
            _max_length(sre_parse.parse(pattern), False)
        except (re.error, ValueError, OverflowError, RecursionError) as e:
            return f"stop_regex {pattern!r} is refused: {e}"
    return None


class StopRegex:
    """The stop_regex patterns of one output (checked by `check_patterns` first)."""

    __slots__ = ("_compiled", "_windows", "hit")

    def __init__(self, patterns: Sequence[str]) -> None:
        self._compiled = [(p, re.compile(p)) for p in patterns]
        self._windows = [_max_length(sre_parse.parse(p), False) for p in patterns]
        self.hit: str | None = None  # the pattern that matched, once one has

    def search(self, text: str, new: int) -> bool:
        """Whether `text` (the output's text so far, of which the last `new` characters
        are new) now matches a pattern; the first such pattern becomes `hit`."""
        if self.hit is not None:
            return True
        for (pattern, compiled), window in zip(self._compiled, self._windows, strict=True):
            start = 0 if window == _UNBOUNDED else max(0, len(text) - new - window + 1)
            if compiled.search(text, start):
                self.hit = pattern
                return True
        return False

    @staticmethod
    def trim_at(text: str, pattern: str) -> int:
        """Where SGLang cuts the text after `pattern` matched: at the first literal
        occurrence of the pattern's characters, else nowhere (the text's length)."""
        pos = text.find(pattern)
        return len(text) if pos == -1 else pos
