"""Tool calls read out of an output *as it streams*: the one parser of calls, for the
frontend (calls streamed to clients and listed in each branch's Done) and the engine
(parallel calls end at the first repeat).

`CallParser(fmt, names).feed(text)` takes the output's text deltas and returns events:
`TextDelta` (plain text, released as soon as it cannot be the start of a call), and per
call `CallBegin(index, name)`, `ArgsDelta(index, text)`…, `CallEnd`. The argument
fragments are the raw JSON text of the call's arguments as the model writes it, so they
concatenate to `CallEnd.arguments`, a JSON object's text. `CallEnd` also gives the call's
whole text (its markup included) and where in the output it ends.

What is held back, by format (`radixlm.tokenizer.tools`):

- a format with markup (``hermes``): text outside ``<tool_call>…</tool_call>`` streams at
  once, except a tail that may be the start of ``<tool_call>``; inside, the JSON object is
  a call, which ends with ``</tool_call>`` (or whatever else follows its object);
- a bare format (``generic`` / ``llama3``): a call answer is only calls, so an output that
  starts with ``{`` (or the format's lead tag, ``<|python_tag|>``) is held until its first
  keys tell: ``{"name": <a known tool>, "arguments": `` is a call (either key order);
  anything else -- another key, a name that is no tool, not an object -- is text,
  released whole, and so is the rest. Calls may follow each other, separated by
  whitespace or ``;``.

With ``one_call`` (``parallel_tool_calls`` false) everything after the first call's end
that would begin a second one is dropped. Names None: any name is a call's (the engine
reads calls a grammar has already checked).

A call's JSON is scanned by `CallObject`, one pass over each character: strings, escapes
and nesting only, and two keys read -- the name (a JSON string) and the arguments (an
object, or a JSON string holding one, which some models write, decoded and sent in one
fragment when complete). Other keys are skipped. The raw argument text is kept as it is
written, so it can be sent in fragments that concatenate to the call's arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

from radixlm.tokenizer.tools import CallFormat, ToolFormat, call_format

__all__ = ["ArgsDelta", "CallBegin", "CallEnd", "CallObject", "CallParser", "Event", "TextDelta"]

WS = " \t\r\n"


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
    arguments: str  # the concatenated fragments: a JSON object's text (when `complete`)
    text: str = ""  # the call as written, its markup included
    end: int = 0  # characters of the output up to the call's end
    complete: bool = True  # False: the output ended inside the call


Event = Union[TextDelta, CallBegin, ArgsDelta, CallEnd]


# -- one call's JSON object --------------------------------------------------------------


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


# -- the parser -----------------------------------------------------------------------------


class CallParser:
    """See the module docstring. `calls` holds the (name, arguments) of the calls ended so
    far, `text` the text outside them."""

    def __init__(self, fmt: ToolFormat | CallFormat, names: Iterable[str] | None, *,
                 one_call: bool = False) -> None:
        f = self.format = call_format(fmt)
        self.names = None if names is None else tuple(names)
        self.one_call = one_call
        self.text_parts: list[str] = []
        self.calls: list[tuple[str, str]] = []  # (name, arguments) of ended calls
        self._held = ""  # text not yet released
        # text (markup: outside calls), start (bare: before the first non-space), call,
        # close (markup: after a call's object), after (bare: between calls), plain, cut
        self._state = "text" if f.begin else "start"
        self._obj: CallObject | None = None
        self._sent_args = 0  # argument characters of the current call already emitted
        self._begun = False  # CallBegin sent for the current call
        self._prefix = ""  # text before the current object (lead tag, spaces)
        self._fed = 0  # characters fed so far
        self._closing: list[str] = []  # markup after a call's object (its end marker)
        self._object_end = 0  # characters of the output up to the current call's end

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._state == "cut":
            return out
        held = self._held
        self._fed += len(text)
        self._run(held + text if held else text, self._fed - len(held) - len(text), out,
                  final=False)
        return out

    def finish(self) -> list[Event]:
        """The output ended: release what is held; a call cut short ends as it stands."""
        out: list[Event] = []
        if self._state == "cut":
            return out
        held = self._held
        self._run(held, self._fed - len(held), out, final=True)
        obj = self._obj
        if self._state == "close" and obj is not None:
            self._end_call(obj, out)
        elif obj is not None:
            if self._begun:
                self._end_call(obj, out, complete=False)
            else:
                self._emit_text(self._prefix + obj.text, out)
                self._obj = None
        elif self._held:
            self._emit_text(self._held, out)
        self._held = ""
        return out

    # -- states --------------------------------------------------------------------------

    def _run(self, text: str, base: int, out: list[Event], final: bool) -> None:
        """Consume `text`, whose first character is the output's `base`-th."""
        self._held = ""
        fmt = self.format
        pos = 0
        while pos < len(text):
            st = self._state
            if st == "plain":
                self._emit_text(text[pos:], out)
                return
            if st == "call":
                pos = self._take_call(text, pos, base, out)
            elif st == "text":  # markup format, outside a call
                at = text.find(fmt.begin, pos)
                if at < 0:
                    keep = 0 if final else _partial_suffix(text, fmt.begin, pos)
                    self._emit_text(text[pos:len(text) - keep], out)
                    self._held = text[len(text) - keep:]
                    return
                self._emit_text(text[pos:at], out)
                pos = at + len(fmt.begin)
                self._start_call(fmt.begin, committed=True)
            elif st == "start":  # bare format, before the first non-space
                rest = text[pos:]
                body = rest.lstrip(WS)
                lead = rest[:len(rest) - len(body)]
                tag = fmt.lead
                if tag and not self._prefix and body[:len(tag)] == tag:
                    self._prefix = lead + tag  # then the call (its spaces stay in the prefix)
                    pos += len(lead) + len(tag)
                    continue
                maybe_tag = tag and not self._prefix and body and tag.startswith(body)
                if not final and (not body or maybe_tag):
                    self._held = rest
                    return
                if not body or body[0] != "{":
                    self._state = "plain"
                    self._emit_text(self._prefix, out)
                    self._prefix = ""
                    continue
                pos += len(lead)
                self._start_call(self._prefix + lead, committed=False)
            elif st == "after":  # bare format, between calls: spaces, ';', then '{' or the end
                while pos < len(text) and text[pos] in WS + ";":
                    pos += 1
                if pos >= len(text):
                    return
                if text[pos] != "{":
                    self._state = "plain"
                else:
                    self._start_call("", committed=False)
            elif st == "close":  # markup format: optional spaces, then the end marker
                pos = self._close(text, pos, base, out, final)
            elif st == "close_ws":
                while pos < len(text) and text[pos] in WS:
                    pos += 1
                if pos < len(text):
                    self._state = "text"
            else:  # cut
                return

    def _start_call(self, prefix: str, committed: bool) -> None:
        self._state = "call"
        self._prefix = prefix
        self._obj = CallObject(self.names, self.format.args_keys, committed)
        self._sent_args = 0
        self._begun = False

    def _begin(self, obj: CallObject, out: list[Event]) -> bool:
        """Announce the current call; False when it is a second one under ``one_call``:
        it and everything after it are dropped."""
        if self.one_call and self.calls:
            self._state, self._obj, self._held = "cut", None, ""
            return False
        out.append(CallBegin(len(self.calls), obj.name or ""))
        self._begun = True
        return True

    def _take_call(self, text: str, pos: int, base: int, out: list[Event]) -> int:
        obj = self._obj
        assert obj is not None
        pos = obj.take(text, pos)
        if obj.verdict is None and obj.name is not None and obj.started_args():
            obj.verdict = True
        if obj.verdict is False:
            self._emit_text(self._prefix + obj.text, out)
            self._obj = None
            self._state = "text" if self.format.begin else "plain"
            return pos
        if obj.verdict and obj.name is not None:
            if not self._begun and not self._begin(obj, out):
                return len(text)
            if not obj.args_string or obj.args_done:
                self._emit_args(obj, out)
        if obj.state == "done":
            self._object_end = base + pos
            if self.format.end:
                self._state = "close"
                self._closing = []
            else:
                self._end_call(obj, out)
                self._state = "after"
        return pos

    def _close(self, text: str, pos: int, base: int, out: list[Event], final: bool) -> int:
        """After a call's object: spaces and the end marker end the call; anything else
        ends it too, and is text."""
        obj = self._obj
        assert obj is not None
        marker = self.format.end
        rest = text[pos:]
        body = rest.lstrip(WS)
        if not body:
            self._closing.append(rest)
            return len(text)
        spaces = len(rest) - len(body)
        if body.startswith(marker):
            self._closing += [rest[:spaces], marker]
            pos += spaces + len(marker)
            self._object_end = base + pos
            self._end_call(obj, out, closed=True)
            self._state = "close_ws"
            return pos
        if marker.startswith(body) and not final:
            self._held = rest
            return len(text)
        self._end_call(obj, out)  # not the marker: the call ended with its object
        self._state = "text"
        return pos + spaces

    def _emit_args(self, obj: CallObject, out: list[Event]) -> None:
        args = "".join(obj.args)
        if len(args) > self._sent_args:
            out.append(ArgsDelta(len(self.calls), args[self._sent_args:]))
            self._sent_args = len(args)

    def _end_call(self, obj: CallObject, out: list[Event], *, closed: bool = False,
                  complete: bool = True) -> None:
        """The current call ends: at its end marker (`closed`), at its object's end, or
        (not `complete`) where the output ended."""
        if not self._begun and not self._begin(obj, out):
            return
        self._emit_args(obj, out)
        args = "".join(obj.args)
        text = self._prefix + obj.text if complete else ""
        if closed:
            text += "".join(self._closing)
        end = self._object_end if complete else self._fed
        out.append(CallEnd(len(self.calls), args, text, end, complete))
        self.calls.append((obj.name or "", args))
        self._begun = False
        self._obj = None
        self._closing = []

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
