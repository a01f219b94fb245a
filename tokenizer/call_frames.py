"""`FramedCalls`: where each tool call ends in an output that a call grammar shapes.

A constrained call answer (`radixlm.tokenizer.tools.call_frame`, the frontend's call
grammar) is ``begin + JSON object + end``, repeated after ``separator`` for parallel
calls. Fed the output's text as it is decoded, `FramedCalls` reports each call as it
completes: its whole text (frame included) and where in the fed piece it ended. The
engine uses it to end a turn whose next call repeats an earlier one word for word (a
small model under ``tool_choice: "required"`` otherwise writes the same call until its
token limit).

One pass over each character: the JSON is scanned for strings, escapes and nesting only
(the grammar has checked it). Text that leaves the frame (content of an ``auto``
request's own schema, in a format whose calls have markup) ends the watch.
"""

from __future__ import annotations

__all__ = ["FramedCalls"]

_BEGIN, _JSON, _END, _SEP, _OFF = range(5)


class FramedCalls:
    """Calls as they complete in one output stream (see the module docstring)."""

    __slots__ = ("_begin", "_end", "_sep", "_phase", "_at", "_depth", "_in_string",
                 "_escape", "_text")

    def __init__(self, begin: str, end: str, separator: str) -> None:
        self._begin, self._end, self._sep = begin, end, separator
        self._phase = _BEGIN if begin else _JSON
        self._at = 0  # characters of the current literal (begin, end, separator) matched
        self._depth = 0
        self._in_string = self._escape = False
        self._text: list[str] = []  # the current call's text so far

    @property
    def watching(self) -> bool:
        return self._phase != _OFF

    def feed(self, piece: str) -> list[tuple[int, str]]:
        """The calls completed in `piece`: (offset in `piece` just past the call, the call's
        text), in order."""
        done: list[tuple[int, str]] = []
        if self._phase == _OFF:
            return done
        start = 0  # where in `piece` the current call's text resumes
        for i, ch in enumerate(piece):
            phase = self._phase
            if phase == _OFF:
                return done
            if phase == _JSON:
                if not self._json_char(ch):
                    continue
                if not self._end:
                    done.append(self._complete(piece, start, i + 1))
                    start = i + 1
                continue
            literal = self._begin if phase == _BEGIN else self._end if phase == _END else self._sep
            if ch != literal[self._at]:
                self._phase = _OFF
                return done
            self._at += 1
            if self._at < len(literal):
                continue
            self._at = 0
            if phase == _BEGIN:
                self._phase = _JSON
            elif phase == _END:
                done.append(self._complete(piece, start, i + 1))
                start = i + 1
            else:  # the separator: the next call begins
                start = i + 1
                self._phase = _BEGIN if self._begin else _JSON
        if self._phase in (_BEGIN, _JSON, _END) and start < len(piece):
            self._text.append(piece[start:])
        return done

    def _json_char(self, ch: str) -> bool:
        """Scan one character of the call's JSON; True when it closes the object."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return False
        if self._depth == 0:  # before the object
            if ch == "{":
                self._depth = 1
            elif ch not in " \t\r\n":
                self._phase = _OFF  # not an object: no call
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                if self._end:
                    self._phase = _END
                return True
        return False

    def _complete(self, piece: str, start: int, stop: int) -> tuple[int, str]:
        text = "".join(self._text) + piece[start:stop]
        self._text = []
        self._phase = _SEP if self._sep else _OFF
        return stop, text
