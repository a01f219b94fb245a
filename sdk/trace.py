"""Tracing a program: its body run against a state that only records what it appends.

``program.trace()`` (SGLang's ``SglFunction.trace``) returns the `TracedState`: the
expressions the body appended (``nodes``), with placeholders for the arguments not given
(`Argument`) and for the values gens and selects would produce (`Variable`). Nothing is
sent to an engine.

``program.cache()`` traces with every argument a placeholder and stops at the first thing
that is not known in advance (an argument, a gen, a fork...): what came before is the
program's constant prefix (`constant_prefix`), which it pins in the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.protocol import Input, Message
from radixlm.sdk.lang import (
    Expr,
    Gen,
    RoleBegin,
    RoleEnd,
    RoleScopes,
    Select,
    Text,
    VarScopeEnd,
    flatten,
)
from radixlm.sdk.state import ProgramStateGroup

__all__ = ["Argument", "Fork", "Join", "StopTracing", "TracedState", "Variable", "constant_prefix",
           "trace"]


class StopTracing(Exception):
    """Raised by a prefix-only trace at the first thing not known in advance."""


@dataclass(frozen=True, eq=False)
class Argument(Expr):
    """A program argument not given to the trace. It can be appended or concatenated,
    but not turned into text (``str()``, f-strings) or tested: its value is unknown."""

    name: str

    def _unknown(self, *args: Any) -> Any:
        raise TypeError(f"argument {self.name!r} has no value while tracing")

    __str__ = __format__ = __bool__ = __len__ = __iter__ = __int__ = __float__ = _unknown  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class Variable(Expr):
    """What ``s[name]`` is while tracing: the value a gen/select would produce."""

    name: Any
    source: Expr | None = None


@dataclass(frozen=True, eq=False)
class Fork(Expr):
    size: int


@dataclass(frozen=True, eq=False)
class Join(Expr):
    mode: str


class TracedState(RoleScopes):
    """A recording program state (the ``s`` of a traced body)."""

    def __init__(self, arguments: dict[str, Any], *, prefix_only: bool) -> None:
        self.arguments = arguments
        self.prefix_only = prefix_only
        self.nodes: list[Expr] = []
        self.variables: dict[Any, Variable] = {}
        self.child_states: list[TracedState] = []
        self.ret_value: Any = None

    def _record(self, items: list[Expr]) -> None:
        for item in items:
            if self.prefix_only and not isinstance(item, (Text, RoleBegin, RoleEnd)):
                raise StopTracing
            if isinstance(item, (Gen, Select)):
                name = item.name if item.name is not None else f"gen_{len(self.variables)}"
                self.variables[name] = Variable(name, item)
            elif isinstance(item, VarScopeEnd):
                self.variables[item.name] = Variable(item.name)
            self.nodes.append(item)

    _append = _record  # what `RoleScopes` appends with

    def __iadd__(self, other: Any) -> TracedState:
        if other is None:
            raise ValueError("tried to append None to a program state")
        self._record(flatten(other))
        return self

    def __getitem__(self, name: Any) -> Any:
        if self.prefix_only:
            raise StopTracing
        given = self.arguments.get(name)
        if given is not None and not isinstance(given, Argument):
            return given
        if name not in self.variables:
            self.variables[name] = Variable(name)
        return self.variables[name]

    get_var = __getitem__

    def __setitem__(self, name: Any, value: Any) -> None:
        self.variables[name] = value if isinstance(value, Variable) else Variable(name)

    set_var = __setitem__

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracedGroup:
        if self.prefix_only:
            raise StopTracing
        self.nodes.append(Fork(int(size)))
        children = []
        for _ in range(int(size)):
            child = TracedState(self.arguments, prefix_only=False)
            child.variables = dict(self.variables)
            children.append(child)
        self.child_states += children
        return TracedGroup(children, self)  # type: ignore[arg-type]

    def _unknown(self, *args: Any, **kwargs: Any) -> Any:
        if self.prefix_only:
            raise StopTracing
        raise TypeError("a traced program has no text, messages or values: it did not run")

    text = messages = sync = error = get_meta_info = _unknown

    def flatten_nodes(self) -> list[Expr]:
        """The recorded expressions, in order (SGLang's name)."""
        return list(self.nodes)

    def __repr__(self) -> str:
        return f"<TracedState: {len(self.nodes)} expressions, {len(self.child_states)} forks>"


class TracedGroup(ProgramStateGroup):
    """What a traced ``s.fork(n)`` returns (appending works as on a real group)."""

    def join(self, mode: str = "gather_variable") -> None:
        parent = self.parent
        assert isinstance(parent, TracedState)
        parent.nodes.append(Join(mode))
        for child in self.states:
            assert isinstance(child, TracedState)
            for name, var in child.variables.items():
                parent.variables.setdefault(name, var)


def trace(func: Callable[..., Any], params: list[str], arguments: dict[str, Any], *,
          prefix_only: bool = False) -> TracedState:
    """Run `func` against a `TracedState`: the given `arguments`, placeholders for the
    other `params`. A prefix-only trace stops quietly at the first unknown."""
    args = {name: Argument(name) for name in params if name not in arguments}
    args.update(arguments)
    state = TracedState(args, prefix_only=prefix_only)
    try:
        state.ret_value = func(state, **args)
    except (StopTracing, TypeError, AttributeError):
        if not prefix_only:
            raise
    return state


def constant_prefix(state: TracedState) -> Input | None:
    """The first piece a run of the program would send, when it is all known in advance:
    the leading text, or the leading whole messages (with constant content)."""
    text: list[str] = []
    messages: list[Message] = []
    role: str | None = None
    content: list[str] = []
    for node in state.nodes:
        if isinstance(node, Text) and role is None and not messages:
            text.append(node.value)
        elif isinstance(node, Text) and role is not None:
            content.append(node.value)
        elif isinstance(node, RoleBegin) and role is None and not text:
            role, content = node.role, []
        elif isinstance(node, RoleEnd) and role == node.role:
            messages.append(Message(role=role, content="".join(content)))
            role = None
        else:
            break
    if messages:
        return Input(messages=messages, add_generation_prompt=False)
    joined = "".join(text)
    return Input(text=joined) if joined else None
