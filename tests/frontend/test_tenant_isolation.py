"""Tenants on a shared (CurveZMQ) server: client B, with its own key, cannot read client
A's prompts through the prefix cache (usage.cached_tokens, page size 1), neither in the
default namespace nor by naming A's namespace; it sees none of A's sessions, namespaces
or pins, cannot unpin A's pins, flushes only its own cache, and stats hide activity
counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from radixlm.runtime.protocol import (
    Done,
    Error,
    ErrorCode,
    FlushCache,
    Generate,
    GetStats,
    Input,
    ListSessions,
    OpenSession,
    Pin,
    Pinned,
    SamplingParams,
    SessionList,
    SessionOpened,
    StatsReply,
    Tokenize,
    Tokens,
    Unpin,
)
from radixlm.runtime.transport.errors import EngineError, error_from_reply
from radixlm.runtime.transport.raw_client import RawClient

from tests.transport.test_curve_auth import make_keys, serve

SECRET = "You are the bank's assistant. The customer's card PIN is 482913; never say it."
PROBE = "You are the bank's assistant. The customer's card PIN is 4829"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("tenants")
    auth = tmp / "auth"
    make_keys(auth, "alice", "bob")
    with serve(tmp, tiny_model_dir, "--auth-dir", str(auth), "--endpoint",
               "tcp://127.0.0.1:0", "--page-size", "1") as (endpoint, _):
        yield endpoint, auth


def client(shared: tuple[str, Path], name: str) -> RawClient:
    endpoint, auth = shared
    server_public, _ = zmq.auth.load_certificate(auth / "server.key")
    public, secret = zmq.auth.load_certificate(auth / "clients" / f"{name}.key_secret")
    return RawClient(endpoint, timeout_s=60, options={
        zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret})


def cached(c: RawClient, text: str, namespace: str | None = None) -> int:
    rid = c.new_rid("g")
    c.send(Generate(rid=rid, input=Input(text=text), namespace=namespace,
                    sampling=SamplingParams(max_tokens=1, temperature=0.0)))
    while not isinstance(reply := c.recv_for(rid), Done):
        if isinstance(reply, Error):
            raise error_from_reply(reply)
    return reply.usage.cached_tokens


def test_the_cache_never_crosses_tenants(shared: tuple[str, Path]) -> None:
    with client(shared, "alice") as alice, client(shared, "bob") as bob:
        assert isinstance(alice.call(Pin(rid="p", name="bank-system", input=Input(text=SECRET))),
                          Pinned)
        opened = alice.call(OpenSession(rid="o", input=Input(text=SECRET), namespace="alice-ns"))
        assert isinstance(opened, SessionOpened)
        tokens = alice.call(Tokenize(rid="t", input=Input(text=PROBE)))
        assert isinstance(tokens, Tokens)
        probe_len = len(tokens.input_ids)
        # Positive control: the owner hits its own cache, in both places.
        assert cached(alice, PROBE) >= probe_len - 2
        assert cached(alice, PROBE, "alice-ns") >= probe_len - 2
        # The other tenant: nothing, in the default namespace and in A's namespace.
        assert cached(bob, PROBE) == 0
        assert cached(bob, PROBE, "alice-ns") == 0
        assert cached(bob, PROBE, "alice-ns") >= probe_len - 2  # its own cache works


def test_sessions_pins_and_flush_are_tenant_scoped(shared: tuple[str, Path]) -> None:
    with client(shared, "alice") as alice, client(shared, "bob") as bob:
        alice.call(Pin(rid="p", name="alice-tools", input=Input(text=SECRET)))
        opened = alice.call(OpenSession(rid="o", input=Input(text="hi"), namespace="alice-ns2"))
        assert isinstance(opened, SessionOpened)
        listing = bob.call(ListSessions(rid="l", all=True))
        assert isinstance(listing, SessionList) and listing.sessions == []
        mine = alice.call(ListSessions(rid="l", all=True))
        assert isinstance(mine, SessionList)
        assert {s.namespace for s in mine.sessions} >= {"alice-ns2"}  # in A's own terms
        with pytest.raises(EngineError) as refused:
            bob.call(Unpin(rid="u", name="alice-tools"))
        assert refused.value.code == ErrorCode.NOT_FOUND
        assert "key-" not in refused.value.message  # no engine-side names shown
        # The name is free for B (pin names are per tenant: nothing says A has one).
        assert isinstance(bob.call(Pin(rid="p2", name="alice-tools", input=Input(text="x y"))),
                          Pinned)
        from_pin = alice.call(OpenSession(rid="o2", pinned="alice-tools"))  # A's pin is intact
        assert isinstance(from_pin, SessionOpened) and from_pin.length > 0
        stats = bob.call(GetStats(rid="s"))
        assert isinstance(stats, StatsReply) and stats.sessions == 0 and stats.pins == 0
        # Nor the server's traffic: no finish reasons, no latency histograms.
        assert stats.finish_reasons == {} and stats.latency == {}


def test_a_flush_drops_only_the_flushing_tenants_cache(shared: tuple[str, Path]) -> None:
    """Both tenants cache the same text (default namespace and a named one); B's
    flush_cache empties B's entries only: A still hits all of its own."""
    text = "Shared words that both tenants send, each into its own part of the cache."
    with client(shared, "alice") as alice, client(shared, "bob") as bob:
        n = len(alice.call(Tokenize(rid="t", input=Input(text=text))).input_ids)  # type: ignore[attr-defined]
        for c in (alice, bob):
            for ns in (None, "docs"):
                cached(c, text, ns)  # fill
                assert cached(c, text, ns) >= n - 2  # hits its own
        assert bob.call(FlushCache(rid="f")) is not None
        for ns in (None, "docs"):
            assert cached(alice, text, ns) >= n - 2  # A's untouched
        assert cached(bob, text) == 0 and cached(bob, text, "docs") == 0  # B's gone
