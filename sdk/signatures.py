"""Methods defined by another method's parameters, so that each parameter list is written
once: the synchronous faces of `AsyncClient` / `AsyncChatSession` (`blocking`, `facing`),
and calls sharing one parameter list (`same_parameters`).

What they make carries the source's real signature: type checkers see it through
``ParamSpec``, ``help()`` and `inspect.signature` through ``__wrapped__`` /
``__signature__`` -- never a bare ``**kwargs: Any``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Concatenate, ParamSpec, TypeVar

__all__ = ["blocking", "constructor_parameters", "facing", "same_parameters"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")
W = TypeVar("W")


def blocking(
    method: Callable[Concatenate[Any, P], Awaitable[R]], inner: str
) -> Callable[Concatenate[Any, P], R]:
    """A blocking method running coroutine method `method` of ``self.<inner>`` in
    ``self._loop`` (a `LoopThread`) and returning its result."""

    @functools.wraps(method)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._loop.call(partial(method, getattr(self, inner), *args, **kwargs))

    return call


def facing(
    method: Callable[Concatenate[Any, P], S], inner: str, wrap: type[W]
) -> Callable[Concatenate[Any, P], W]:
    """A method calling plain method `method` of ``self.<inner>`` and returning
    ``wrap(self._loop, result)``: the synchronous face (a class) of what it returned."""

    @functools.wraps(method)
    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> W:
        return wrap(self._loop, method(getattr(self, inner), *args, **kwargs))

    call.__signature__ = inspect.signature(method).replace(  # type: ignore[attr-defined]
        return_annotation=wrap.__name__)
    return call


def _declare(fn: Callable[..., Any], source: Callable[..., Any], skip: int) -> None:
    """Give `fn` the parameters of `source` (less its first `skip`), keeping its return."""
    params = list(inspect.signature(source).parameters.values())[skip:]
    returns = inspect.signature(fn).return_annotation
    signature = inspect.Signature(params, return_annotation=returns)
    fn.__signature__ = signature  # type: ignore[attr-defined]


def same_parameters(
    source: Callable[Concatenate[Any, P], Any],
) -> Callable[[Callable[..., R]], Callable[Concatenate[Any, P], R]]:
    """Declare that the decorated method takes exactly method `source`'s parameters (it
    passes them on to `source`); its own return type stays."""

    def apply(fn: Callable[..., R]) -> Callable[Concatenate[Any, P], R]:
        _declare(fn, source, 0)
        return fn

    return apply


def constructor_parameters(
    cls: Callable[P, Any],
) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Declare that the decorated function takes exactly `cls`'s constructor parameters."""

    def apply(fn: Callable[..., R]) -> Callable[P, R]:
        _declare(fn, cls.__init__, 1)  # type: ignore[misc]  # less `self`
        return fn

    return apply
