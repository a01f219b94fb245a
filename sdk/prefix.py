"""A program's constant prefix in the engine: `CachedPrefix` (what ``program.cache()``
pinned) and `strip_prefix` (whether a state's first input starts with it, and the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.protocol import Input

__all__ = ["CachedPrefix", "strip_prefix"]


@dataclass
class CachedPrefix:
    """A program's constant prefix, pinned in the engine under `name` (``cache()``);
    `gone` once a run found the pin no longer there (unpinned)."""

    name: str
    input: Input
    gone: bool = False


def strip_prefix(first: Input, prefix: Input) -> tuple[bool, Input | None]:
    """Whether `first` (a state's first piece of input) starts with `prefix`, and what is
    left of it after the prefix (None: nothing)."""
    if prefix.text is not None:
        if first.text is None or not first.text.startswith(prefix.text):
            return False, None
        rest = first.text[len(prefix.text):]
        return True, Input(text=rest) if rest else None
    known = prefix.messages or []
    given = first.messages
    if given is None or given[:len(known)] != known:
        return False, None
    rest = given[len(known):]
    if rest or first.add_generation_prompt:
        return True, Input(messages=rest, add_generation_prompt=first.add_generation_prompt)
    return True, None
