"""Per-tenant retention quotas (issue 24): on a server with several tenants one tenant
cannot fill the retention cap for all -- beyond its quota its own opens and pins get
`capacity` (demoting only its own idle soft sessions first), another tenant's still fit,
and no refusal shows another tenant's figures or the server-wide total.

Namespaces are the engine-side ones the frontend makes (``TENANT`` / ``TENANT/NS``);
the expected counts follow from the prompts' lengths (distinct paths, page size 1)."""

from __future__ import annotations

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.wire import EngineOpenSession, EnginePin
from radixlm.runtime.protocol import Error, ErrorCode, SessionOpened
from scheduler_harness import make_harness, tiny_dir  # noqa: F401 - the fixtures

from tests.engine.test_sessions_in_scheduler import C, sessions_by_id

CAP = 240
LEN = 40  # each open's prompt: distinct first token, so no two share a path


def _open(h, tenant: str, i: int, retention: str = "hard", client: bytes = C):  # noqa: ANN001, ANN202
    ids = [3 + i] + [7 + (i % 5)] * (LEN - 1)
    h.send(EngineOpenSession(client=client, rid=f"{tenant}{i}", input_ids=ids,
                             namespace=tenant, retention=retention))
    h.run()
    return h.replies.pop()


def _multi(make_harness, **kw):  # noqa: ANN001, ANN202, F811
    config = EngineConfig(retained_cap=CAP, auth_dir="/keys", **kw)
    return make_harness(sessions=True, engine_config=config)


def test_one_tenant_cannot_fill_the_cap_for_all(make_harness) -> None:  # noqa: ANN001, F811
    h = _multi(make_harness, max_retained_per_tenant=120)
    opened = []
    for i in range(5):  # 5 x 40 tokens asked, 120 allowed
        reply = _open(h, "alice", i)
        opened.append(reply)
    ok = [r for r in opened if isinstance(r, SessionOpened)]
    refused = [r for r in opened if isinstance(r, Error)]
    assert len(ok) == 120 // LEN and len(refused) == 2, opened
    for r in refused:
        assert r.code == ErrorCode.CAPACITY
        assert "retention quota" in r.message and "of its 120 tokens" in r.message, r.message
    bob = [_open(h, "bob", 10 + i) for i in range(3)]  # bob's own quota is untouched
    assert all(isinstance(r, SessionOpened) for r in bob), bob
    h.send(EnginePin(client=C, rid="pin", name="bob/p", input_ids=[99] * LEN,
                     namespace="bob"))
    h.run()
    pin = h.replies.pop()
    assert isinstance(pin, Error) and pin.code == ErrorCode.CAPACITY, pin
    assert "this tenant's pins and sessions retain 120 of its 120" in pin.message, pin.message
    for r in [*refused, pin]:  # only the asker's own figures: never the server's total
        assert "240" not in r.message and str(CAP) not in r.message, r.message


def test_the_default_quota_is_an_equal_share(make_harness) -> None:  # noqa: ANN001, F811
    h = _multi(make_harness)  # no --max-retained-per-tenant
    assert isinstance(_open(h, "bob", 50), SessionOpened)  # two tenants retain: half each
    replies = [_open(h, "alice", i) for i in range(6)]
    ok = sum(isinstance(r, SessionOpened) for r in replies)
    assert ok == (CAP // 2) // LEN, replies
    refused = [r for r in replies if isinstance(r, Error)]
    assert refused and all("equal share" in r.message for r in refused), refused


def test_a_tenants_quota_demotes_only_its_own_soft_sessions(make_harness) -> None:  # noqa: ANN001, F811
    h = _multi(make_harness, max_retained_per_tenant=80)
    bob = _open(h, "bob", 20, retention="soft")
    alice = [_open(h, "alice", i, retention="soft") for i in range(2)]
    assert all(isinstance(r, SessionOpened) for r in [bob, *alice])
    third = _open(h, "alice", 2, retention="soft")  # over her quota: her LRU soft goes
    assert isinstance(third, SessionOpened), third
    by_id = sessions_by_id(h)
    assert by_id[bob.session].retention == "soft"  # another tenant's stays held
    assert by_id[alice[0].session].retention == "demoted"
    assert by_id[third.session].retention == "soft"


def test_a_server_without_tenants_keeps_the_whole_cap(make_harness) -> None:  # noqa: ANN001, F811
    h = make_harness(sessions=True, engine_config=EngineConfig(retained_cap=CAP))
    replies = [_open(h, f"ns{i % 2}", i) for i in range(7)]  # namespaces are not tenants
    assert sum(isinstance(r, SessionOpened) for r in replies) == CAP // LEN
    refused = [r for r in replies if isinstance(r, Error)]
    assert refused and f"of {CAP} tokens" in refused[0].message
