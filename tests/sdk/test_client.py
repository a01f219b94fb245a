"""The SDK's client layer against the protocol stub (radixlm.testing): plain calls,
streaming, chat sessions, typed errors, cancellation and dead-engine detection.

The stub's toy model is recomputed here (`toy_generate`) as the independent reference.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import anyio
import pytest
import radixlm as rl
from radixlm.runtime.protocol import Abort, Generate, Message
from radixlm.testing import StubServer, render_chatml
from toy_stub import chars, text_of, toy_generate

pytest_plugins = ["toy_stub"]  # its fixtures: stub, client


@pytest.fixture
def slow_stub() -> Iterator[StubServer]:
    with StubServer(token_delay_s=0.02) as server:
        yield server


def test_generate_returns_text_ids_and_sglang_meta(client: rl.Client) -> None:
    result = client.generate("Hello", max_tokens=12, temperature=0)
    expected = toy_generate(chars("Hello"), 12)
    assert result.token_ids == expected
    assert result.text == text_of(expected)
    meta = result.meta_info
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(expected)
    assert meta["cached_tokens"] >= 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    branches = client.generate(input_ids=chars("Hi"), max_tokens=3, n=3)
    assert [b.index for b in branches] == [0, 1, 2]


def test_messages_are_rendered_by_the_engine(client: rl.Client, stub: StubServer) -> None:
    result = client.generate(messages=[{"role": "user", "content": "hey"}], max_tokens=4)
    rendered = render_chatml([Message(role="user", content="hey")], True)
    assert result.meta_info["prompt_tokens"] == len(rendered)
    assert result.token_ids == toy_generate(chars(rendered), 4)


def test_stream_deltas_concatenate_to_the_result(client: rl.Client) -> None:
    with client.stream("Stream me", max_tokens=20, ignore_eos=True) as stream:
        deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == stream.result.text
    assert [t for d in deltas for t in d.token_ids] == stream.result.token_ids
    assert stream.result.text == text_of(toy_generate(chars("Stream me"), 20, ignore_eos=True))


def test_bad_input_raises_typed_errors(client: rl.Client) -> None:
    with pytest.raises(rl.InvalidParamsError) as info:
        client.generate("x", max_tokens=-1)
    assert info.value.code == "invalid_params" and isinstance(info.value, rl.EngineError)
    with pytest.raises(rl.EmptyPromptError):
        client.generate("", max_tokens=1)
    with pytest.raises(rl.NotFoundError):
        client.generate("x", session="no-such-session", max_tokens=1)
    with pytest.raises(rl.InvalidParamsError):  # refused before sending: two inputs
        client.generate("x", input_ids=[1], max_tokens=1)
    served = client.generate("still serving", max_tokens=2, ignore_eos=True)
    assert served.meta_info["completion_tokens"] == 2


def test_chat_session_sends_only_the_new_message(client: rl.Client, stub: StubServer) -> None:
    with client.session(system="Be brief.", temperature=0) as chat:
        first = chat.send("Hi", max_tokens=5)
        before = len(stub.received_of(Generate))
        second = chat.send("Again", max_tokens=5)
        sent = stub.received_of(Generate)[before:]
        assert [m.input.messages[0].content for m in sent] == ["Again"]
        assert len(sent[0].input.messages) == 1
        # Turn 2 hits everything turn 1 left in the session.
        assert second.meta_info["cached_tokens"] == first.meta_info["session_length"]
        assert [m["role"] for m in chat.history] == ["system", "user", "assistant", "user",
                                                     "assistant"]
        left, right = chat.fork(2)
        a, b = left.send("left", max_tokens=3), right.send("right", max_tokens=3)
        assert a.session != b.session
        assert a.meta_info["cached_tokens"] == second.meta_info["session_length"]
        assert client.stats()["sessions"] == 3
    assert client.stats()["sessions"] == 0  # forks closed with their parent


def test_leaving_a_stream_early_aborts_it(slow_stub: StubServer) -> None:
    with rl.connect(slow_stub.endpoint) as client:
        with client.session() as chat:
            with chat.stream("tell me everything", max_tokens=500, ignore_eos=True) as s:
                for _ in s:
                    break
            assert slow_stub.received_of(Abort), "no abort was sent"
            # The session is idle again: the next turn is accepted at once.
            assert chat.send("next", max_tokens=1).meta_info["completion_tokens"] == 1
        stats = client.stats()
        assert stats["sessions"] == 0 and stats["running"] == 0


def test_cancelled_async_call_aborts_in_the_engine(slow_stub: StubServer) -> None:
    async def main() -> None:
        async with rl.AsyncClient(slow_stub.endpoint) as client:
            with anyio.move_on_after(0.2) as scope:
                await client.generate("long", max_tokens=1000, ignore_eos=True)
            assert scope.cancelled_caught
            assert client.in_flight == 0
            # Many concurrent calls share one socket and overlap in the engine.
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(lambda i=i: client.generate(f"p{i}", max_tokens=3))
            assert client.peak_generating == 6
    anyio.run(main)
    assert slow_stub.running == 0
    assert slow_stub.max_running >= 6


def test_connection_to_nothing_fails_fast(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(rl.EngineDeadError):
        rl.connect(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.5)
    assert time.monotonic() - start < 3
    with pytest.raises(ValueError, match="ZeroMQ"):
        rl.connect("http://localhost:30000")


def test_silent_engine_fails_calls_within_seconds() -> None:
    with StubServer() as stub, rl.connect(stub.endpoint, heartbeat_timeout=1.5) as client:
        client.generate("ok", max_tokens=1)
        stub.silent = True  # hangs: receives everything, answers nothing (pings included)
        start = time.monotonic()
        with pytest.raises(rl.EngineDeadError):
            client.generate("hello?", max_tokens=5)
        assert time.monotonic() - start < 4
        with pytest.raises(rl.EngineDeadError):  # later calls fail at once
            client.stats()


def test_async_stream_and_stats(stub: StubServer) -> None:
    async def main() -> None:
        async with rl.AsyncClient(stub.endpoint) as client:
            pieces = []
            async with client.stream("abc", max_tokens=8, ignore_eos=True) as s:
                async for delta in s:
                    pieces.append(delta.text)
            assert "".join(pieces) == s.result.text
            stats = await client.stats()
            assert {"sessions", "prompt_tokens_total", "cached_tokens_total"} <= set(stats)
            async with client.session() as chat:
                reply = await chat.send("hi", max_tokens=2)
                assert reply.session == chat.id
    anyio.run(main)


def test_repl_runs_scripted_turns(stub: StubServer, capsys: pytest.CaptureFixture[str]) -> None:
    from radixlm.sdk.repl import main

    assert main(["--endpoint", stub.endpoint, "--max-tokens", "4", "--message", "hi",
                 "--message", "/stats", "--message", "again"]) == 0
    out = capsys.readouterr().out
    assert out.count("cached") == 2 and "sessions 1" in out


def test_engine_flags_become_serve_flags() -> None:
    from radixlm.sdk.engine import engine_flags

    assert engine_flags({"kv_tokens": 4096, "device": "cpu", "default_session_ttl_s": 30,
                         "flag": True, "off": False, "unset": None}) == [
        "--kv-tokens", "4096", "--device", "cpu", "--session-ttl", "30", "--flag"]


def test_unawaited_closes_leave_together_as_one_request(stub: StubServer) -> None:
    from radixlm.runtime.protocol import CloseSession

    async def main() -> None:
        async with rl.AsyncClient(stub.endpoint) as ac:
            sessions = [(await ac.open_session()).session for _ in range(3)]
            before = len(stub.received_of(CloseSession))
            for sid in sessions:
                ac.close_session_unawaited(sid)
            await ac.stats()  # the deferred close leaves ahead of this request
            closes = stub.received_of(CloseSession)[before:]
            assert [m.ids() for m in closes] == [sessions]  # one request, three sessions
            assert (await ac.stats())["sessions"] == 0

    anyio.run(main)
