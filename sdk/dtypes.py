"""``gen(dtype=...)``: a Python type as a regex constraint plus stop strings, as SGLang
does it (``sglang.lang.backend.runtime_endpoint.RuntimeEndpoint._handle_dtype_to_regex``).

    int   -> REGEX_INT,   and stops " " and "\\n" added
    float -> REGEX_FLOAT, and stops " " and "\\n" added
    str   -> REGEX_STR    (a double-quoted run of word characters and spaces)
    bool  -> REGEX_BOOL   ("True" or "False")

The type may also be given by name (``"int"``). A dtype replaces a `regex` given with it
(SGLang warns and keeps the dtype's). The regexes have SGLang's values, so programs that
import them (``from sglang.lang.ir import REGEX_INT``) can import them from here.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

__all__ = ["REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "DtypeConstraint",
           "dtype_constraint"]

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_NUMBER_STOPS = (" ", "\n")
_BY_TYPE: dict[Any, tuple[str, tuple[str, ...]]] = {
    int: (REGEX_INT, _NUMBER_STOPS),
    float: (REGEX_FLOAT, _NUMBER_STOPS),
    str: (REGEX_STR, ()),
    bool: (REGEX_BOOL, ()),
}
_BY_NAME = {t.__name__: v for t, v in _BY_TYPE.items()}


class DtypeConstraint(NamedTuple):
    regex: str
    stop: tuple[str, ...]  # added to the gen's own stop strings


def dtype_constraint(dtype: Any, regex: str | None = None) -> DtypeConstraint:
    """The regex and extra stop strings of `dtype` (int, float, str, bool, or its name)."""
    try:
        found = _BY_TYPE.get(dtype) or _BY_NAME.get(dtype)
    except TypeError:  # an unhashable dtype
        found = None
    if found is None:
        raise ValueError(f"gen(dtype=...) takes int, float, str or bool (or their names), "
                         f"got {dtype!r}")
    if regex is not None:
        warnings.warn(f"gen() got both dtype={dtype!r} and regex={regex!r}: the dtype's regex "
                      f"is used (as SGLang does)", stacklevel=3)
    return DtypeConstraint(*found)
