"""Retention accounting at the cap: opens sent back to back are counted as they are
accepted (later ones get `capacity`, not all of them pass), and a session that holds none
of its history is listed as "demoted", not "hard"."""

from __future__ import annotations

from pathlib import Path

from radixlm.runtime import protocol as wire

from tests.conftest import assert_pool_clean, start_test_server

CAP = 100


def test_pipelined_opens_respect_the_cap_and_listing_shows_the_true_class(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--retained-cap", str(CAP),
                           "--page-size", "1") as server, server.client() as c:
        for i in range(40):  # 40 opens of 20 tokens on distinct paths, none awaited
            ids = [10 + i] + [5] * 19
            c.send(wire.OpenSession(rid=f"o{i}", input=wire.Input(input_ids=ids)))
        replies = [c.recv_for(f"o{i}") for i in range(40)]
        opened = [r for r in replies if isinstance(r, wire.SessionOpened)]
        refused = [r for r in replies if isinstance(r, wire.Error)]
        assert {r.code for r in refused} == {wire.ErrorCode.CAPACITY}
        assert len(opened) == CAP // 20, (len(opened), len(refused))
        stats = c.stats()
        assert stats.retained_tokens.get("hard", 0) <= CAP
        c.call(wire.CloseSession(rid="c", sessions=[r.session for r in opened]))

        empty = c.call(wire.OpenSession(rid="e"))
        assert isinstance(empty, wire.SessionOpened)
        long_turn = list(range(20, 20 + 2 * CAP))  # grows it past the cap at once
        c.generate(wire.Input(input_ids=long_turn), session=empty.session, max_tokens=1,
                   temperature=0.0)
        [info] = [s for s in c.list_sessions() if s.session == empty.session]
        assert c.stats().retained_tokens.get("hard", 0) == 0  # it holds nothing ...
        assert info.retention == "demoted"  # ... and says so
        c.call(wire.CloseSession(rid="c2", session=empty.session))
        assert_pool_clean(c)
