"""Sessions waiting on tools through the SDK and the ZeroMQ protocol (the real server,
tiny model): a chat turn that ends in a call leaves its session waiting on that tool
(the listing says so), `chat.tool_done_soon()` is answered, the result's turn ends the
wait and the engine's stats carry the tool's round trip. The pool is checked after."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import radixlm as rl

pytestmark = pytest.mark.usefixtures("pool_integrity")

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "find a word",
          "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 6}},
                         "required": ["q"], "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def engine(server: Any) -> Iterator[rl.Client]:
    with rl.connect(server.endpoint) as client:
        yield client


def listed(engine: rl.Client, sid: str) -> dict[str, Any]:
    return next(s for s in engine.list_sessions() if s["session"] == sid)


def test_a_call_turn_waits_on_its_tool_until_the_result(engine: rl.Client) -> None:
    with engine.session(system="Use tools.", retention="soft") as chat:
        reply = chat.send("find cache", tools=[LOOKUP], tool_choice="required",
                          temperature=1.0, max_tokens=60, seed=3)
        assert reply.tool_calls and reply.tool_calls[0].name == "lookup"
        assert chat.id is not None
        info = listed(engine, chat.id)
        assert info["tools"] == ["lookup"] and info["tier"] == "device"
        assert engine.stats()["tool_waits"] == {"device": 1}
        chat.tool_done_soon()  # (its history is held: nothing to bring back)
        time.sleep(0.05)
        call = reply.tool_calls[0]
        chat.send("cache: found", role="tool", tool_call_id=call.id, name=call.name,
                  max_tokens=2, temperature=0)
        assert listed(engine, chat.id).get("tools") is None
        stats = engine.stats()
        assert stats["tool_waits"] == {}
        assert 0.05 <= stats["tool_round_trip_s"]["lookup"] < 30
        assert stats["prefetch"]["hinted"] >= 1


def test_a_turn_without_tools_waits_on_nothing(engine: rl.Client) -> None:
    with engine.session(system="Plain.") as chat:
        chat.send("hello", max_tokens=3, temperature=0)
        assert chat.id is not None and listed(engine, chat.id).get("tools") is None
        chat.tool_done_soon()  # answered all the same
    with pytest.raises(rl.ProgramError):
        chat.tool_done_soon()  # closed
