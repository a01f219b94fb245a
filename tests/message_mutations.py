"""Hypothesis strategies shared by the protocol fuzz and schema tests: nested values of
every msgpack type, and valid messages with a few fields (possibly nested ones)
replaced, dropped or added."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st


def nested_values(scalars: st.SearchStrategy[Any], *, max_size: int,
                  max_leaves: int) -> st.SearchStrategy[Any]:
    """`scalars`, and lists and maps of them, nested."""
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=max_size),
            st.dictionaries(st.text(max_size=2 * max_size), inner, max_size=max_size),
        ),
        max_leaves=max_leaves,
    )


@st.composite
def mutated(draw: st.DrawFn, corpus: Sequence[dict[str, Any]], values: st.SearchStrategy[Any],
            added_keys: Sequence[str], edits: tuple[int, int]) -> dict[str, Any]:
    """A message of `corpus` with between `edits[0]` and `edits[1]` fields replaced by,
    or added as, one of `values`, or dropped, at any depth."""
    message = copy.deepcopy(draw(st.sampled_from(corpus)))
    for _ in range(draw(st.integers(*edits))):
        target = message
        # Walk into a nested map now and then (input, sampling, usage...).
        while True:
            nested = [k for k, v in target.items() if isinstance(v, dict)]
            if not nested or not draw(st.booleans()):
                break
            target = target[draw(st.sampled_from(sorted(nested)))]
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        keys = sorted(target)
        if action == "replace" and keys:
            target[draw(st.sampled_from(keys))] = draw(values)
        elif action == "drop" and keys:
            del target[draw(st.sampled_from(keys))]
        else:
            target[draw(st.sampled_from(added_keys))] = draw(values)
    return message
