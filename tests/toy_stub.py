"""Shared by the SDK tests that run against `radixlm.testing.StubServer`: its fixtures
(import them into a test module to use them) and the toy model recomputed independently
of the SDK, the reference those tests compare with.

- ``stub`` (module): a `StubServer` answering at once.
- ``client`` (function): an `rl.connect` client of it; at teardown the stub must hold no
  session and run nothing (the test left no state behind).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import pytest
import radixlm as rl
from radixlm.testing import EOS, StubServer, toy_next_token


def toy_generate(ids: list[int], max_tokens: int, *, ignore_eos: bool = False,
                 shift: int = 0, min_tokens: int = 0,
                 stop_token_ids: Collection[int] = ()) -> list[int]:
    """The stub's continuation of `ids` (`shift`: a sampled branch's seed + index): it
    ends at EOS or a stop id, neither of which may come before `min_tokens` tokens
    (SGLang's min_new_tokens masks them)."""
    enders = set(stop_token_ids) | (set() if ignore_eos else {EOS})
    out: list[int] = []
    for _ in range(max_tokens):
        token = toy_next_token(ids + out, shift, enders if len(out) < min_tokens else ())
        out.append(token)
        if token in enders:
            break
    return out


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def text_of(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids if t != EOS)


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


@pytest.fixture
def client(stub: StubServer) -> Iterator[rl.Client]:
    with rl.connect(stub.endpoint) as c:
        yield c
        stats = c.stats()  # answered after everything the test sent
        assert stats["sessions"] == 0 and stats["running"] == 0, "the test left state behind"
