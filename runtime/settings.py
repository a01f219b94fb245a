"""Settings, each declared once.

A setting is a field of a frozen msgspec config (`EngineConfig` in `runtime/config.py`,
`HttpConfig` in `runtime/http/config.py`, `RouterConfig` in `runtime/router/config.py`)
whose annotation carries its `setting(...)`: help text, command-line spelling and
aliases (the peers' spellings: vLLM, llama-server, SGLang), bounds or rule, group in
``--help``, and the processes that read it. Its type (a `Literal` is its choices) and
its default are the field's own:

    max_running: Annotated[int, setting(
        "most requests decoding at once", "--max-running", ge=1, group=SCHEDULING)] = 64

Everything else is derived from that one place: the flags of every command
(`add_settings`), the config of parsed flags (`config_from_args`), the check of every
value (`Settings.__post_init__`: where a config is built, and again in each child
process that decodes its spec, as msgspec runs it there too) and the names `rl.Engine`
takes as keywords (`Setting.keywords`). msgspec ignores the declaration itself.
"""

from __future__ import annotations

import argparse
import functools
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

__all__ = ["LOG_LEVELS", "PROCESSES", "Declaration", "LogLevel", "Setting", "SettingError",
           "Settings", "add_settings", "config_from_args", "number", "setting", "settings_of"]

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = typing.get_args(LogLevel)
# Who reads a setting: the process `radixlm serve` runs in (which binds, supervises and
# drains), the engine, the protocol frontend, the HTTP API, the router.
PROCESSES = frozenset({"serve", "engine", "frontend", "http", "router"})


class SettingError(ValueError):
    """A value a setting does not take (the message names its flag, or its field)."""


@dataclass(frozen=True)
class Declaration:
    """What `setting(...)` says of one field; see the module docstring."""

    help: str
    flags: tuple[str, ...]  # in --help's order; the first long one is its own spelling
    read_by: tuple[str, ...]
    group: str  # its --help section ("": the command's own options)
    metavar: str | None
    bounds: tuple[tuple[str, float], ...]  # (">=", 1), ...
    rule: Callable[[Any], bool] | None  # a rule bounds cannot say...
    rule_text: str  # ...in words, after "must be"
    keywords: tuple[str, ...]  # more names `rl.Engine` takes for it (the field name is one)
    default_text: str | None  # what --help says of the default, when not the value


def setting(help: str, *flags: str, read_by: str | tuple[str, ...] = "engine",  # noqa: A002
            group: str = "", metavar: str | None = None, ge: float | None = None,
            gt: float | None = None, le: float | None = None, lt: float | None = None,
            rule: Callable[[Any], bool] | None = None, rule_text: str = "",
            keywords: tuple[str, ...] = (), default_text: str | None = None) -> Declaration:
    """Declare a setting (in a field's `Annotated[...]`); no flags: not on a command line."""
    read = (read_by,) if isinstance(read_by, str) else read_by
    if not read or not PROCESSES.issuperset(read):
        raise ValueError(f"read_by={read_by!r}: name processes of {sorted(PROCESSES)}")
    if (rule is None) != (not rule_text):
        raise ValueError("a rule needs its rule_text, and the other way round")
    bounds = tuple((op, v) for op, v in ((">=", ge), (">", gt), ("<=", le), ("<", lt))
                   if v is not None)
    return Declaration(help, flags, read, group, metavar, bounds, rule, rule_text, keywords,
                       default_text)


_HOLDS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda v, b: v >= b, ">": lambda v, b: v > b,
    "<=": lambda v, b: v <= b, "<": lambda v, b: v < b,
}


@dataclass(frozen=True)
class Setting:
    """One declared field of a config class (`settings_of`)."""

    name: str
    kind: type  # bool, int, float or str (of a Literal: its values' type)
    optional: bool  # None is a value (and means "not set")
    choices: tuple[Any, ...] | None  # a Literal's values
    default: Any
    declared: Declaration

    @property
    def flag(self) -> str | None:
        """Its own spelling: the first long flag declared (``--model``, not ``-m``)."""
        flags = self.declared.flags
        return next((f for f in flags if f.startswith("--")), flags[0]) if flags else None

    @property
    def keywords(self) -> tuple[str, ...]:
        """The names `rl.Engine` takes for it."""
        return (self.name, *self.declared.keywords)

    @property
    def keyword(self) -> str:
        """How `rl.Engine`'s messages name it: the first keyword declared, else its field."""
        return self.declared.keywords[0] if self.declared.keywords else self.name

    @property
    def spelled(self) -> str:
        """How messages name it: its flag, else its field."""
        return self.flag or self.name

    def problem(self, value: Any, shown: str | None = None) -> str | None:
        """Why `value` is refused ("must be >= 1, got 0"; `shown`: how to quote it), None
        if it is taken."""
        got = f"got {repr(value) if shown is None else shown}"
        if value is None:
            return None if self.optional else f"must be given, {got}"
        if isinstance(value, bool) != (self.kind is bool) or not isinstance(
                value, (int, float) if self.kind is float else self.kind):
            return f"must be {_KIND_WORDS[self.kind]}, {got}"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {', '.join(map(str, self.choices))}, {got}"
        if self.kind in (int, float) and (math.isnan(value) or not all(
                _HOLDS[op](value, b) for op, b in self.declared.bounds)):
            return f"must be {self._range()}, {got}"
        if self.declared.rule is not None and not self.declared.rule(value):
            return f"must be {self.declared.rule_text}, {got}"
        return None

    def _range(self) -> str:
        """The bounds in words: ">= 1", "in (0, 1]"."""
        bounds = self.declared.bounds
        low = [(op, b) for op, b in bounds if op in (">=", ">")]
        high = [(op, b) for op, b in bounds if op in ("<=", "<")]
        if low and high:
            (lo_op, lo), (hi_op, hi) = low[0], high[0]
            return f"in {'[' if lo_op == '>=' else '('}{lo:g}, {hi:g}{']' if hi_op == '<=' else ')'}"
        return " and ".join(f"{op} {b:g}" for op, b in bounds)

    def parse(self, text: str) -> Any:
        """A command line's text as this setting's value; `argparse.ArgumentTypeError`
        saying why for one it refuses."""
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid {self.kind.__name__} value: {text!r}") from None
        if self.choices is not None:
            return value  # argparse says "invalid choice" itself, listing them
        problem = self.problem(value, shown=text)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value


_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _scalar(annotation: Any) -> tuple[type, bool, tuple[Any, ...] | None]:
    """(kind, optional, choices) of a field's type without its declaration."""
    args = typing.get_args(annotation)
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        optional = len(rest) < len(args)
        if len(rest) != 1:
            raise TypeError(f"a setting holds one kind of value, not {annotation}")
        annotation, args = rest[0], typing.get_args(rest[0])
    if typing.get_origin(annotation) is Literal:
        return type(args[0]), optional, args
    if annotation not in (bool, int, float, str):
        raise TypeError(f"a setting is a bool, int, float, str or Literal, not {annotation}")
    return annotation, optional, None


@functools.cache
def settings_of(config_type: type) -> tuple[Setting, ...]:
    """The declared settings of a config class, in declaration order."""
    hints = typing.get_type_hints(config_type, include_extras=True)
    found = []
    for field in msgspec.structs.fields(config_type):
        hint = hints[field.name]
        if typing.get_origin(hint) is not typing.Annotated:
            continue
        declared = [m for m in hint.__metadata__ if isinstance(m, Declaration)]
        if not declared:
            continue
        kind, optional, choices = _scalar(hint.__origin__)
        default = field.default if field.default is not msgspec.NODEFAULT else None
        found.append(Setting(field.name, kind, optional, choices, default, declared[0]))
    return tuple(found)


class Settings(msgspec.Struct, frozen=True):
    """Base of a config of declared settings: every value is checked as it is built (by a
    caller, or by msgspec decoding a child's spec), raising `error`."""

    error: ClassVar[type[ValueError]] = SettingError

    def __post_init__(self) -> None:
        for s in settings_of(type(self)):
            problem = s.problem(getattr(self, s.name))
            if problem is not None:
                raise self.error(f"{s.spelled} {problem}")


# -- the command line ------------------------------------------------------------------------


def _group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group `title` (made on first use; "" = the parser itself)."""
    if not title:
        return parser
    for group in parser._action_groups:  # argparse keeps no lookup by title
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _help(s: Setting, default: Any, shown: str | None = None) -> str:
    text = s.declared.help.replace("%", "%%")
    shown = shown or s.declared.default_text or (s.default if default is None else default)
    if s.kind is bool or shown in ("", None):  # a flag; a path that is none by default
        return text
    return f"{text} (default: {str(shown).replace('%', '%%')})"


def _metavar(s: Setting) -> str | None:
    """argparse's own: the choices ({a,b}), else the flag's name (--page-size: PAGE_SIZE),
    which need not be the field's."""
    return None if s.choices or s.flag is None else s.flag.lstrip("-").replace("-", "_").upper()


def add_settings(parser: argparse.ArgumentParser, config_type: type, *,
                 only: Collection[str] | None = None, skip: Collection[str] = (),
                 defaults: Mapping[str, Any] | None = None, shown: Mapping[str, str] | None = None,
                 into: Any = None) -> list[str]:
    """Add the flags of `config_type`'s settings (those named in `only`, less `skip`) to
    `parser`, each in its declared group (or all `into` one, such as a mutually exclusive
    group), its value stored under the field's name; `defaults` replaces a default (None:
    "not given", which `config_from_args` reads as the declared default) and `shown` what
    --help says of it (a default the command decides). Returns the names added."""
    added = []
    for s in settings_of(config_type):
        if not s.flag or s.name in skip or (only is not None and s.name not in only):
            continue
        options: dict[str, Any] = {"dest": s.name}
        default = (defaults or {}).get(s.name, s.default)
        if s.kind is bool:
            options["action"] = "store_true"
        else:
            options.update(default=default, type=s.parse, choices=s.choices,
                           metavar=s.declared.metavar or _metavar(s))
        (into or _group(parser, s.declared.group)).add_argument(
            *s.declared.flags, help=_help(s, default, (shown or {}).get(s.name)), **options)
        added.append(s.name)
    return added


def number(kind: type, *, ge: float | None = None, gt: float | None = None
           ) -> Callable[[str], Any]:
    """An argparse type for a command's own number that is no setting (``--max-tokens``),
    with the bounds and messages of settings."""
    return Setting("value", kind, False, None, None, setting("", ge=ge, gt=gt)).parse


C = TypeVar("C", bound=Settings)


def config_from_args(args: argparse.Namespace, config_type: type[C], **fixed: Any) -> C:
    """The frozen config of `config_type` for parsed flags: each setting with a flag from
    `args` (when given there and not None), else its default; `fixed` values win."""
    values = {s.name: getattr(args, s.name) for s in settings_of(config_type)
              if s.flag and s.name not in fixed and getattr(args, s.name, None) is not None}
    return config_type(**values, **fixed)
