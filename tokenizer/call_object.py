"""`CallObject`: one call's JSON object, scanned a character at a time as it streams.

The scan follows strings, escapes and nesting only (one pass over each character) and
reads two keys: the name (a JSON string: a known tool's, or any with no names given)
and the arguments (an object, or a JSON string holding one, which some models write).
Other keys are skipped. The raw argument text is kept as it is written, so it can be sent
in fragments that concatenate to the call's arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["WS", "CallObject"]

WS = " \t\r\n"


class CallObject:
    """See the module docstring. `verdict`: None while undecided, True once it is a call
    (a known name and the arguments key, or a complete object with a known name), False
    when it is not."""

    __slots__ = ("names", "args_keys", "state", "raw", "key", "current", "name", "args",
                 "args_string", "args_done", "verdict", "value", "depth", "in_str", "esc")

    def __init__(self, names: Iterable[str] | None, args_keys: tuple[str, ...],
                 committed: bool) -> None:
        self.names = None if names is None else frozenset(names)
        self.args_keys = args_keys
        self.state = "open"  # open, key_or_end, key, colon, value, after_value, done
        self.raw: list[str] = []  # every character taken (released as text if not a call)
        self.key: list[str] = []
        self.current: str | None = None  # the key whose value is being read
        self.name: str | None = None
        self.args: list[str] = []  # raw argument text taken so far
        self.args_string = False  # arguments sent as a JSON string (decoded at its end)
        self.args_done = False
        self.verdict: bool | None = True if committed else None
        self.value: list[str] = []
        self.depth = 0
        self.in_str = False
        self.esc = False

    @property
    def text(self) -> str:
        return "".join(self.raw)

    def take(self, text: str, start: int) -> int:
        """Consume `text[start:]` up to the object's end; returns the position after it."""
        i, n = start, len(text)
        raw = self.raw
        while i < n and self.state != "done" and self.verdict is not False:
            ch = text[i]
            i += 1
            raw.append(ch)
            st = self.state
            if st == "value":
                self._value_char(ch)
            elif st == "key":
                self._key_char(ch)
            elif st == "open":
                if ch == "{":
                    self.state = "key_or_end"
                elif ch not in WS:
                    self.verdict = False
            elif st == "key_or_end":
                if ch == '"':
                    self.state, self.key, self.esc = "key", [], False
                elif ch == "}" and self.name is not None:
                    self._close()
                elif ch not in WS:
                    self.verdict = False
            elif st == "colon":
                if ch == ":":
                    self.state = "value"
                    self.value, self.depth, self.in_str, self.esc = [], 0, False, False
                elif ch not in WS:
                    self.verdict = False
            elif st == "after_value":
                if ch == ",":
                    self.state = "key_or_end"
                elif ch == "}":
                    self._close()
                elif ch not in WS:
                    self.verdict = False
        return i

    def started_args(self) -> bool:
        """Whether the arguments' value has started (decides a call with a known name)."""
        return self.current in self.args_keys and (bool(self.value) or self.args_done)

    def _key_char(self, ch: str) -> None:
        if self.esc:
            self.esc = False
            self.key.append(ch)
        elif ch == "\\":
            self.esc = True
            self.key.append(ch)
        elif ch == '"':
            try:
                self.current = json.loads('"' + "".join(self.key) + '"')
            except ValueError:
                self.verdict = False
                return
            if self.current == "name" and self.name is not None:
                self.verdict = False  # a second name: not a call
            self.state = "colon"
        else:
            self.key.append(ch)

    def _value_char(self, ch: str) -> None:
        key = self.current
        is_args = key in self.args_keys and not self.args_done
        if not self.value and not self.in_str and self.depth == 0:
            if ch in WS:
                return
            if (key == "name" and ch != '"') or (is_args and ch not in '{"'):
                self.verdict = False
                return
            if is_args:
                self.args_string = ch == '"'
        self.value.append(ch)
        if is_args and not self.args_string:
            self.args.append(ch)
        ended = False
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                ended = self.depth == 0
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            ended = self.depth == 0
        elif self.depth == 0 and ch in ",}" + WS:
            self.value.pop()  # a bare scalar (number, true, ...) ended on this character
            self._scalar_end(ch)
            return
        if ended:
            self._value_end()

    def _scalar_end(self, ch: str) -> None:
        if self.current == "name" or self.current in self.args_keys:
            self.verdict = False
            return
        self.state = "after_value"
        if ch == ",":
            self.state = "key_or_end"
        elif ch == "}":
            self._close()

    def _value_end(self) -> None:
        self.state = "after_value"
        text = "".join(self.value)
        if self.current == "name":
            try:
                name = json.loads(text)
            except ValueError:
                self.verdict = False
                return
            if self.names is not None and name not in self.names:
                self.verdict = False
                return
            self.name = name
            if self.args and self.verdict is None:
                self.verdict = True
        elif self.current in self.args_keys and not self.args_done:
            self.args_done = True
            if self.args_string:
                try:
                    inner = json.loads(text)
                    ok = isinstance(json.loads(inner), dict)
                except (ValueError, TypeError):
                    ok = False
                if not ok:
                    self.verdict = False
                    return
                self.args = [inner]

    def _close(self) -> None:
        self.state = "done"
        if self.name is None:
            self.verdict = False
            return
        if self.verdict is None:
            self.verdict = True
        if not self.args:
            self.args = ["{}"]
