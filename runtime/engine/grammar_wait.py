"""Requests whose grammar is still compiling: they wait in `RequestTable.compiling`
(holding no KV) while other requests keep decoding, and join the waiting queue once
the compiler thread is done; a grammar that does not compile fails its request with
`invalid_params` and the compiler's message."""

from __future__ import annotations

import logging

from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.request import RequestGroup
from radixlm.runtime.engine.table import RequestTable
from radixlm.runtime.grammar.compiler import CompilingGrammar, GrammarError
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)


def release_compiled(table: RequestTable, endings: Endings) -> None:
    """Move every group whose compilation finished to `waiting` (branches in arrival
    order), or fail it."""
    if not table.compiling:
        return
    groups: dict[int, RequestGroup] = {}
    for r in table.compiling:
        groups.setdefault(id(r.group), r.group)
    for g in groups.values():
        pending = g.grammar
        assert isinstance(pending, CompilingGrammar)
        if not pending.done():
            continue
        try:
            g.grammar = pending.result()
        except GrammarError as e:
            endings.fail_group(g, RequestError(ErrorCode.INVALID_PARAMS, str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - a compiler failure is this request's alone
            log.exception("grammar compilation failed for %s", g.rid)
            endings.fail_group(g, RequestError(
                ErrorCode.INTERNAL, f"grammar compilation failed: {type(e).__name__}: {e}"))
            continue
        table.release(g)
