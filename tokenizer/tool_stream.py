"""Tool calls read out of an output *as it streams*: text deltas, and each call's name
first, then its argument fragments.

`CallStream(fmt, names).feed(text)` takes the output's text deltas and returns events:
`TextDelta` (plain text, released as soon as it cannot be the start of a call), and per
call `CallBegin(index, name)`, `ArgsDelta(index, text)`…, `CallEnd(index, arguments)`.
The argument fragments are the raw JSON text of the call's arguments as the model writes
it, so they concatenate to `CallEnd.arguments`, a JSON object's text.

What is held back, by format (`radixlm.tokenizer.tools`):

- ``hermes``: text outside ``<tool_call>…</tool_call>`` streams at once, except a tail
  that may be the start of ``<tool_call>``; inside, the JSON object is a call.
- ``generic`` / ``llama3``: a call answer is only calls, so an output that starts with
  ``{`` (or ``<|python_tag|>``) is held until its first keys tell: ``{"name": <a known
  tool>, "arguments": `` is a call (either key order); anything else -- another key, a
  name that is no tool, not an object -- is text, released whole, and so is the rest.

A call's JSON is scanned incrementally (strings, escapes, nesting), one pass over each
character. Keys other than the name and the arguments are skipped; arguments given as a
JSON string holding the object are decoded and sent in one fragment when complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

from radixlm.tokenizer.tools import ToolFormat

__all__ = ["ArgsDelta", "CallBegin", "CallEnd", "CallStream", "TextDelta"]

HERMES_BEGIN = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WS = " \t\r\n"


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallBegin:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    arguments: str  # the concatenated fragments: a JSON object's text


Event = Union[TextDelta, CallBegin, ArgsDelta, CallEnd]


class _CallObject:
    """One call object's JSON, scanned a character at a time.

    `verdict`: None while undecided, True once it is a call (a known name and the
    arguments key, or a complete object with a known name), False when it is not.
    """

    def __init__(self, names: Iterable[str], args_keys: tuple[str, ...], committed: bool) -> None:
        self.names = set(names)
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
        # value scanning
        self.value: list[str] = []
        self.depth = 0
        self.in_str = False
        self.esc = False

    def _fail(self) -> None:
        self.verdict = False

    def take(self, text: str, start: int) -> int:
        """Consume `text[start:]` up to the object's end; returns the position after it."""
        i = start
        n = len(text)
        while i < n and self.state != "done" and self.verdict is not False:
            ch = text[i]
            i += 1
            self.raw.append(ch)
            st = self.state
            if st == "open":
                if ch == "{":
                    self.state = "key_or_end"
                elif ch not in _WS:
                    self._fail()
            elif st == "key_or_end":
                if ch == '"':
                    self.state = "key"
                    self.key = []
                    self.esc = False
                elif ch == "}" and self.name is not None:
                    self._close()
                elif ch not in _WS:
                    self._fail()
            elif st == "key":
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
                        self._fail()
                        continue
                    if self.current == "name" and self.name is not None:
                        self._fail()
                    self.state = "colon"
                else:
                    self.key.append(ch)
            elif st == "colon":
                if ch == ":":
                    self.state = "value"
                    self.value, self.depth, self.in_str, self.esc = [], 0, False, False
                elif ch not in _WS:
                    self._fail()
            elif st == "value":
                self._value_char(ch)
            elif st == "after_value":
                if ch == ",":
                    self.state = "key_or_end"
                elif ch == "}":
                    self._close()
                elif ch not in _WS:
                    self._fail()
        return i

    def _value_char(self, ch: str) -> None:
        key = self.current
        is_args = key in self.args_keys and not self.args_done
        if not self.value and not self.in_str and self.depth == 0:
            if ch in _WS:
                return
            if key == "name" and ch != '"':
                return self._fail()
            if is_args and ch not in '{"':
                return self._fail()
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
        elif self.depth == 0 and ch in ",}" + _WS:
            # a bare scalar (number, true, ...) ended on this character
            self.value.pop()
            return self._scalar_end(ch)
        if ended:
            self._value_end()

    def _scalar_end(self, ch: str) -> None:
        if self.current == "name" or self.current in self.args_keys:
            return self._fail()
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
                return self._fail()
            if name not in self.names:
                return self._fail()
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
                    return self._fail()
                self.args = [inner]

    def _close(self) -> None:
        self.state = "done"
        if self.name is None:
            return self._fail()
        if self.verdict is None:
            self.verdict = True
        if not self.args:
            self.args = ["{}"]

    def on_args_key(self) -> bool:
        """Whether the arguments' value has started (decides a generic call)."""
        return self.current in self.args_keys and (bool(self.value) or self.args_done)


class CallStream:
    """See the module docstring. `text` and `calls` hold what was emitted so far."""

    def __init__(self, fmt: ToolFormat, names: Iterable[str]) -> None:
        self.fmt = fmt
        self.names = tuple(names)
        self.args_keys = ("parameters", "arguments") if fmt == "llama3" else ("arguments", "parameters")
        self.text_parts: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (name, arguments) of finished calls
        self._held = ""  # text not yet released (TEXT state)
        self._state = "start" if fmt != "hermes" else "text"  # start, text, plain, call, after
        self._obj: _CallObject | None = None
        self._sent_args = 0  # argument characters of the current call already emitted
        self._begun = False  # CallBegin sent for the current call
        self._prefix = ""  # text before the current object (python tag, <tool_call>, ws)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._run(self._held + text, out, final=False)
        return out

    def finish(self) -> list[Event]:
        """The output ended: release what is held; a call cut short ends as it stands."""
        out: list[Event] = []
        self._run(self._held, out, final=True)
        obj = self._obj
        if obj is not None:
            if self._begun:
                self._emit_args(obj, out)
                self._end_call(obj, out)
            else:
                self._emit_text(self._prefix + "".join(obj.raw), out)
            self._obj = None
        elif self._held:
            self._emit_text(self._held, out)
        self._held = ""
        return out

    # -- states ------------------------------------------------------------------------------

    def _run(self, text: str, out: list[Event], final: bool) -> None:
        self._held = ""
        pos = 0
        while pos < len(text):
            st = self._state
            if st == "plain":
                self._emit_text(text[pos:], out)
                return
            if st == "text":  # hermes, outside a call
                at = text.find(HERMES_BEGIN, pos)
                if at < 0:
                    keep = 0 if final else _partial_suffix(text, HERMES_BEGIN, pos)
                    self._emit_text(text[pos:len(text) - keep], out)
                    self._held = text[len(text) - keep:]
                    return
                self._emit_text(text[pos:at], out)
                pos = at + len(HERMES_BEGIN)
                self._start_call(HERMES_BEGIN, committed=True)
            elif st == "start":  # generic / llama3, before the first non-space
                rest = text[pos:]
                body = rest.lstrip(_WS)
                lead = rest[:len(rest) - len(body)]
                tag = self.fmt == "llama3" and not self._prefix and body[:len(PYTHON_TAG)] == PYTHON_TAG
                if tag:  # <|python_tag|>, then the call (its spaces stay in the prefix)
                    self._prefix = lead + PYTHON_TAG
                    pos += len(lead) + len(PYTHON_TAG)
                    continue
                maybe_tag = (self.fmt == "llama3" and not self._prefix and body
                             and PYTHON_TAG.startswith(body))
                if not final and (not body or maybe_tag):
                    self._held = rest
                    return
                if not body or body[0] != "{":
                    self._held, self._state = "", "plain"
                    self._emit_text(self._prefix, out)
                    self._prefix = ""
                    continue
                pos += len(lead)
                self._start_call(self._prefix + lead, committed=False)
            elif st == "call":
                pos = self._take_call(text, pos, out)
            elif st == "after":  # between generic calls: spaces, ';', then '{' or the end
                while pos < len(text) and text[pos] in _WS + ";":
                    pos += 1
                if pos >= len(text):
                    return
                if text[pos] == "{":
                    self._start_call("", committed=False)
                else:
                    self._state = "plain"
            elif st == "close":  # hermes: optional spaces, then </tool_call>
                rest = text[pos:]
                body = rest.lstrip(_WS)
                if not body:
                    return
                if body.startswith(HERMES_END):  # the spaces after it go too
                    pos += len(rest) - len(body) + len(HERMES_END)
                    self._state = "close_ws"
                elif HERMES_END.startswith(body) and not final:
                    self._held = rest
                    return
                else:
                    self._state = "text"
                    pos += len(rest) - len(body)
            elif st == "close_ws":
                while pos < len(text) and text[pos] in _WS:
                    pos += 1
                if pos < len(text):
                    self._state = "text"
            else:
                raise AssertionError(st)

    def _start_call(self, prefix: str, committed: bool) -> None:
        self._state = "call"
        self._prefix = prefix
        self._obj = _CallObject(self.names, self.args_keys, committed)
        self._sent_args = 0
        self._begun = False

    def _take_call(self, text: str, pos: int, out: list[Event]) -> int:
        obj = self._obj
        assert obj is not None
        pos = obj.take(text, pos)
        if obj.verdict is None and obj.name is not None and obj.on_args_key():
            obj.verdict = True
        if obj.verdict is False:
            self._emit_text(self._prefix + "".join(obj.raw), out)
            self._obj = None
            self._state = "text" if self.fmt == "hermes" else "plain"
            return pos
        if obj.verdict and obj.name is not None:
            if not self._begun:
                out.append(CallBegin(len(self.calls), obj.name))
                self._begun = True
            if not obj.args_string or obj.args_done:
                self._emit_args(obj, out)
        if obj.state == "done":
            self._end_call(obj, out)
            self._obj = None
            self._state = "close" if self.fmt == "hermes" else "after"
        return pos

    def _emit_args(self, obj: _CallObject, out: list[Event]) -> None:
        args = "".join(obj.args)
        if len(args) > self._sent_args:
            out.append(ArgsDelta(len(self.calls), args[self._sent_args:]))
            self._sent_args = len(args)

    def _end_call(self, obj: _CallObject, out: list[Event]) -> None:
        if not self._begun:
            out.append(CallBegin(len(self.calls), obj.name or ""))
        self._emit_args(obj, out)
        args = "".join(obj.args)
        out.append(CallEnd(len(self.calls), args))
        self.calls.append((obj.name or "", args))
        self._begun = False

    def _emit_text(self, text: str, out: list[Event]) -> None:
        if text:
            self.text_parts.append(text)
            if out and isinstance(out[-1], TextDelta):
                out[-1] = TextDelta(out[-1].text + text)
            else:
                out.append(TextDelta(text))


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """Length of the longest tail of `text[start:]` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - k:]):
            return k
    return 0
