"""Message, tool-call and tool counts are bounded before rendering (issue 24): each renders
to a token at least, so more of them than the context holds are refused as too_long at
once, whatever their text -- 100,000 one-character messages once took the frontend from
76 to 458 MB while it rendered them."""

from __future__ import annotations

import msgpack
import pytest
from radixlm.runtime.protocol import Error, ErrorCode
from radixlm.runtime.transport.raw_client import RawClient

from tests.server.test_bad_input_errors import gen, good_request_succeeds

MESSAGE = {"role": "user", "content": "x"}
CALL = {"id": "c", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize(("frame", "says"), [
    (gen(input={"messages": [MESSAGE] * 100_000}), "100000 messages"),
    (gen(input={"messages": [{"role": "assistant", "tool_calls": [CALL] * 50_000}]}),
     "50001 with their tool calls"),
    (gen(tools=[{"name": f"f{i}"} for i in range(20_000)]), "20000 tool definitions"),
    ({"type": "tokenize", "input": {"messages": [MESSAGE] * 100_000}}, "100000 messages"),
    ({"type": "open_session", "input": {"messages": [MESSAGE] * 100_000}}, "100000 messages"),
], ids=["messages", "tool-calls", "tools", "tokenize", "open-session"])
def test_counts_beyond_the_context_are_refused_before_rendering(
        raw_client: RawClient, frame: dict, says: str) -> None:
    rid = raw_client.new_rid("count")
    raw_client.send_raw(msgpack.packb({**frame, "rid": rid}))
    reply = raw_client.recv_for(rid, 60)
    assert isinstance(reply, Error) and reply.code == ErrorCode.TOO_LONG, reply
    assert says in reply.message, reply.message
    good_request_succeeds(raw_client)
