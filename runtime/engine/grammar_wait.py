"""Requests held back: their grammar still compiling, or their history still being read
from the disk tier (sessions/disk_backup.py). They wait in `RequestTable.compiling`
(holding no KV) while other requests keep decoding, and join the waiting queue once
the compiler thread and the disk are done; a grammar that does not compile fails its
request with `invalid_params` and the compiler's message."""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.request import RequestGroup
from radixlm.runtime.engine.table import RequestTable
from radixlm.runtime.grammar.compiler import CompilingGrammar, GrammarError
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)


def release_compiled(table: RequestTable, endings: Endings,
                     loading: Callable[[RequestGroup], bool] = lambda g: False) -> None:
    """Move every group whose compilation (and disk read: `loading`) finished to
    `waiting` (branches in arrival order), or fail it."""
    if not table.compiling:
        return
    groups: dict[int, RequestGroup] = {}
    for r in table.compiling:
        groups.setdefault(id(r.group), r.group)
    for g in groups.values():
        if loading(g):
            continue
        pending = g.grammar
        if not isinstance(pending, CompilingGrammar):
            table.release(g)
            continue
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
