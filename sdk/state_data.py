"""`StateData`: what a program state holds -- its text, chat messages, variables and
their meta info, the role and variable scopes open -- and the local operations that
change it (text, roles, variables), applied without talking to the engine.

Roles: a whole message (``rl.user("hi")``) becomes one protocol ``Message`` for the
engine to render as a template delta. An assistant turn containing ``gen``/``select``
asks for the assistant header instead (`open_turn`), and the engine closes the turn when
the next message is appended, so the SDK never needs the chat template. What is to be
sent goes to the state's `SessionHandle`, which sends it with the next request.

Written only by the state's executor, in the event loop; `ProgramState` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from radixlm.runtime.protocol import Message
from radixlm.sdk.errors import ProgramError
from radixlm.sdk.lang import RoleBegin, RoleEnd, Text, VarScopeBegin, VarScopeEnd
from radixlm.sdk.session_handle import SessionHandle
from radixlm.sdk.stream_meta import StreamLog
from radixlm.sdk.text_buffer import TextBuffer

__all__ = ["LOCAL_OPS", "GenOutput", "SetVarOp", "StateData"]


class SetVarOp(NamedTuple):
    """``s[name] = value`` while the program runs."""

    name: Any
    value: Any


class GenOutput(NamedTuple):
    """Where a gen's output is: in the state's text, and in its session's history."""

    text_start: int
    text_end: int
    prompt_tokens: int  # the session's length before the output


class StateData:
    """A state's text, messages, variables and meta info, and its open role/scopes."""

    __slots__ = ("buffer", "fork_text_pos", "messages", "meta", "outputs", "role", "role_content",
                 "role_open", "role_start", "scopes", "session", "streams", "var_done",
                 "variables")

    def __init__(self, session: SessionHandle) -> None:
        self.session = session  # where the text and messages to send go
        self.buffer = TextBuffer()  # the text (its `length` read without joining it)
        self.fork_text_pos = 0  # where a fork's own text starts (what a join appends)
        self.messages: list[dict[str, str]] = []
        self.variables: dict[Any, Any] = {}
        self.meta: dict[Any, Any] = {}
        self.var_done: set[Any] = set()
        self.role: str | None = None
        self.role_open = False  # the assistant header was sent: generated text follows it
        self.role_content: list[str] = []
        self.role_start = 0  # where the current role's content starts in the text
        self.scopes: dict[str, int] = {}  # var_scope name -> where its text starts
        self.streams: dict[Any, StreamLog] = {}  # streaming gens' tokens and logprobs
        self.outputs: dict[Any, GenOutput] = {}  # where each gen's output is

    @property
    def text(self) -> str:
        return str(self.buffer)

    # -- variables ------------------------------------------------------------------------------

    def set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value
        self.var_done.add(name)

    def scope_begin(self, name: str) -> None:
        self.scopes[name] = self.buffer.length

    def scope_end(self, name: str) -> None:
        """``with s.var_scope(name)`` ended: the text appended inside is the variable."""
        start = self.scopes.pop(name, None)
        if start is None:  # pragma: no cover - var_scope() always submits both
            raise ProgramError(f"var_scope({name!r}) ended without beginning")
        self.set_var(name, self.buffer.since(start))

    # -- text and roles -------------------------------------------------------------------------

    def add_text(self, value: str) -> None:
        """Text the program appended: sent with the next request."""
        self.buffer.append(value)
        if self.role is not None:
            self.role_content.append(value)
        if self.role is None or self.role_open:
            self.session.pend_text(value)

    def add_generated(self, value: str) -> None:
        """Text the engine produced: already in the session's history."""
        self.buffer.append(value)
        if self.role is not None:
            self.role_content.append(value)

    def role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ProgramError(f"rl.{role}() inside rl.{self.role}(): roles cannot nest")
        self.role, self.role_open, self.role_content = role, False, []
        self.role_start = self.buffer.length

    def role_end(self, role: str) -> None:
        if self.role != role:
            raise ProgramError(f"{role}_end() without a matching {role}_begin()")
        content = "".join(self.role_content)
        if not self.role_open:
            self.session.pend_message(Message(role=role, content=content))
        self.messages.append({"role": role, "content": content})
        self.role, self.role_open, self.role_content = None, False, []

    def open_turn(self) -> None:
        """Before generating inside a role: send the assistant header, then the turn's text."""
        if self.role is None or self.role_open:
            return
        if self.role != "assistant":
            raise ProgramError(
                f"gen()/select() inside rl.{self.role}() is not supported: the engine renders "
                f"{self.role} messages whole; generate inside rl.assistant(...)"
            )
        self.session.pend_generation_prompt()
        self.role_open = True
        self.session.pend_text("".join(self.role_content))

    def replace_output(self, out: GenOutput, answer: str) -> None:
        """Put `answer` where a gen's output was in the text (the session is the
        handle's to cut back)."""
        after = str(self.buffer)[out.text_end:]
        self.buffer.truncate(out.text_start)
        self.buffer.append(answer + after)
        if self.role is not None:
            self.role_content = [self.buffer.since(self.role_start)]

    # -- forks -----------------------------------------------------------------------------------

    def copy_from(self, parent: StateData) -> None:
        """Start as a fork of `parent`: the same text, messages, variables and scopes."""
        self.buffer = parent.buffer.copy()
        self.fork_text_pos = parent.buffer.length
        self.messages = list(parent.messages)
        self.variables = dict(parent.variables)
        self.meta = dict(parent.meta)
        self.var_done = set(parent.var_done)
        self.role, self.role_open = parent.role, parent.role_open
        self.role_content = list(parent.role_content)
        self.role_start = parent.role_start
        self.scopes = dict(parent.scopes)
        self.outputs = dict(parent.outputs)

    def gather(self, children: list[StateData]) -> None:
        """``join("gather_variable")``: each variable the forks made, as a list here."""
        before = set(self.variables)
        for child in children:
            for key, value in child.variables.items():
                if key in before:
                    continue
                self.variables.setdefault(key, []).append(value)
                self.meta.setdefault(key, []).append(child.meta.get(key))
                self.var_done.add(key)

    def fork_text(self) -> str:
        """The text this fork added after it was forked."""
        return self.buffer.since(self.fork_text_pos)


# Ops that never talk to the engine, applied without a coroutine: (data, op) -> None.
LOCAL_OPS: dict[type, Callable[[StateData, Any], None]] = {
    Text: lambda data, op: data.add_text(op.value),
    RoleBegin: lambda data, op: data.role_begin(op.role),
    RoleEnd: lambda data, op: data.role_end(op.role),
    SetVarOp: lambda data, op: data.set_var(op.name, op.value),
    VarScopeBegin: lambda data, op: data.scope_begin(op.name),
    VarScopeEnd: lambda data, op: data.scope_end(op.name),
}
