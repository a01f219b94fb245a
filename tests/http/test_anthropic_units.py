"""The Messages API's pieces without a server: request conversion and its refusals,
breakpoints, the reply's blocks and events, thinking, holds and Anthropic's cache
accounting.

References: the `anthropic` SDK's own stream accumulator (`accumulate_event`: a stream's
events must add up to the non-streamed reply's blocks), `radixlm.sdk.reasoning`'s
`split_reasoning` (the thinking split), brute force (common prefixes, lookback windows),
and the worked examples of Anthropic's prompt-caching docs (mixed TTLs).
"""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from http_helpers import real_anthropic
from radixlm.runtime.http.anthropic.convert import Cut, breakpoints_of, convert, prefix_of, sampling
from radixlm.runtime.http.anthropic.holds import Hold, PrefixHolds, PrefixKeys, common_prefix, pack
from radixlm.runtime.http.anthropic.prompt_cache import (
    Mark,
    TenantCache,
    TokenizedPrompt,
    cache_usage,
    candidates,
    predict,
)
from radixlm.runtime.http.anthropic.reply import BlockWriter, stop_reason
from radixlm.runtime.http.anthropic.schemas import MessagesRequest
from radixlm.runtime.http.anthropic.thinking import ThinkingSplitter
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.protocol import CallDelta, Chunk, Done, NamedToolChoice, ToolCall, Usage
from radixlm.sdk.reasoning import REASONING_FORMATS, split_reasoning

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _req(**fields: object) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return msgspec.json.decode(json.dumps(body).encode(), type=MessagesRequest)


def _refused(says: str, **fields: object) -> None:
    with pytest.raises(ApiError) as e:
        req = _req(**fields)
        convert(req)
        sampling(req)
    assert e.value.status == 400 and says in e.value.message, e.value.message


# -- conversion -----------------------------------------------------------------------------


def test_a_tool_loop_converts_to_chat_messages() -> None:
    req = _req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
               tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather",
                                          "disable_parallel_tool_use": True},
               messages=[
                   {"role": "user", "content": "Weather in Paris and Oslo?"},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "hmm", "signature": "s"},
                       {"type": "text", "text": "Checking."},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                        "input": {"city": "Paris"}},
                       {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                        "input": {"city": "Oslo"}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                       {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                        "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}]},
                       {"type": "text", "text": "And tomorrow?"}]}])
    conv = convert(req)
    got = [(m.role, m.content, m.tool_call_id, m.name) for m in conv.prompt.messages]
    assert got == [("system", "Be brief.\n\nUse tools.", None, None),
                   ("user", "Weather in Paris and Oslo?", None, None),
                   ("assistant", "Checking.", None, None),
                   ("tool", "sunny", "toolu_1", "get_weather"),
                   ("tool", "Error: no\n\ndata", "toolu_2", "get_weather"),
                   ("user", "And tomorrow?", None, None)]
    calls = conv.prompt.messages[2].tool_calls
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls or []] == [
        ("toolu_1", "get_weather", {"city": "Paris"}), ("toolu_2", "get_weather", {"city": "Oslo"})]
    assert conv.prompt.tools is not None and conv.prompt.tools[0].parameters == TOOL["input_schema"]
    assert conv.tool_choice == NamedToolChoice(name="get_weather") and conv.parallel is False


@pytest.mark.parametrize(("choice", "expect"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")])
def test_tool_choice(choice: dict[str, str], expect: str) -> None:
    conv = convert(_req(tools=[TOOL], tool_choice=choice))
    assert conv.tool_choice == expect and conv.parallel


@pytest.mark.parametrize(("fields", "says"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "image"),
    ({"system": [{"type": "text", "text": "x", "citations": [{"type": "x"}]}]}, "citations"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}]}, "search_result"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]},
                   {"role": "user", "content": "x"}]}, "server_tool_use"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"thread": {"type": "create"}}, "threads"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "non-empty"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]},
     "prefill"),
    ({"messages": []}, "empty"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "maybe"}}, "maybe"),
    ({"tools": [{"name": "x"}]}, "input_schema"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4000}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}, "max_tokens": 1000}, "budget_tokens"),
    ({"thinking": {"type": "loud"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": "s",
         "cache_control": {"type": "ephemeral"}}]}, {"role": "user", "content": "x"}]}, "thinking"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}, "ephemeral"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "'5m' or '1h'"),
])
def test_refusals_name_what_is_refused(fields: dict[str, object], says: str) -> None:
    _refused(says, **fields)


def test_a_thread_is_refused_as_anthropics_sdks_expect() -> None:
    """A tool runner of the SDK asks for a server-side thread first; the refusal's
    ``details.error_code`` makes it send the whole conversation instead."""
    from radixlm.runtime.http.anthropic.errors import body

    with pytest.raises(ApiError) as e:
        convert(_req(thread={"type": "create"}))
    error = body(e.value, "req_1")["error"]
    assert error["details"] == {"error_code": "thread_unsupported_request",
                                "unsupported": ["thread"]}


def test_breakpoints_count_blocks_in_anthropic_order_and_are_checked() -> None:
    cc = {"type": "ephemeral"}
    req = _req(tools=[TOOL, {**TOOL, "name": "b", "cache_control": {**cc, "ttl": "1h"}}],
               system=[{"type": "text", "text": "S", "cache_control": cc}],
               messages=[{"role": "user", "content": "plain"},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "tool_result", "tool_use_id": "t",
                                                       "content": [{"type": "text", "text": "r",
                                                                    "cache_control": cc}]}]}])
    marks, blocks = breakpoints_of(req)
    assert blocks == 2 + 1 + 1 + 1 + 2
    assert [(b.block, b.ttl_s, b.cut) for b in marks] == [
        (1, 3600.0, Cut("tools", 1)), (2, 300.0, Cut("system", 0)),
        (6, 300.0, Cut("messages", 2, 1))]
    # top-level cache_control: a breakpoint on the last block (not twice)
    auto = _req(cache_control=cc, messages=[{"role": "user", "content": "x"}])
    assert [(b.block, b.cut) for b in breakpoints_of(auto)[0]] == [(0, Cut("messages", 0, 0))]
    five = [{"type": "text", "text": str(i), "cache_control": cc} for i in range(5)]
    _refused("A maximum of 4 blocks", system=five)
    _refused("'1h'", system=[{"type": "text", "text": "a", "cache_control": cc},
                             {"type": "text", "text": "b", "cache_control": {**cc, "ttl": "1h"}}])


def test_a_breakpoint_prefix_is_the_request_cut_after_its_block() -> None:
    req = _req(tools=[TOOL, {**TOOL, "name": "b"}], system="S",
               messages=[{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                         {"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "text", "text": "y"}]}])
    tools_cut = prefix_of(req, Cut("tools", 0))
    assert tools_cut.messages == [] and [t.name for t in tools_cut.tools or []] == ["get_weather"]
    cut = prefix_of(req, Cut("messages", 2, 0))
    assert [(m.role, m.content) for m in cut.messages] == [
        ("system", "S"), ("user", "u1"), ("assistant", "a1"), ("user", "x")]
    assert len(cut.tools or []) == 2


# -- reply: thinking, blocks and events ---------------------------------------------------------


@pytest.mark.parametrize(("text", "forced"), [
    ("<think>\nweigh it\n</think>\n\nThe answer.", False), ("plain answer", False),
    ("  <think>cut off", False), ("<think>x</think>", False), ("reason</think> answer", True),
    ("<think><think>twice</think>b", True), ("thinking only", True)])
def test_thinking_splits_as_separate_reasoning(text: str, forced: bool) -> None:
    fmt = REASONING_FORMATS["qwen3-thinking" if forced else "qwen3"]
    reasoning, answer = split_reasoning(text.lstrip() if not forced else text, fmt)
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text))))
        splitter = ThinkingSplitter(forced)
        pieces, at = [], 0
        for cut in [*cuts, len(text)]:
            pieces += splitter.feed(text[at:cut])
            at = cut
        pieces += splitter.finish()
        assert "".join(t for k, t in pieces if k == "thinking") == reasoning
        assert "".join(t for k, t in pieces if k == "text") == answer.lstrip()


def _done(text: str, calls: list[ToolCall] | None = None, reason: str = "stop",
          completion: int = 5, matched: object = None) -> Done:
    return Done(rid="r", finish_reason=reason, text=text, token_ids=[], tool_calls=calls,
                matched_stop=matched, usage=Usage(prompt_tokens=9, cached_tokens=0,
                                                  completion_tokens=completion))


def _chunks() -> tuple[list[Chunk], Done]:
    """A streamed reply: thinking, text, then two calls, in the frontend's chunk shape."""
    c1, c2 = "call_aa", "call_bb"
    chunks = [
        Chunk(rid="r", text="<thi", token_ids=[]),
        Chunk(rid="r", text="nk>plan</think>\n", token_ids=[]),
        Chunk(rid="r", text="Let me check. ", token_ids=[], content="Let me check. "),
        Chunk(rid="r", text="{...", token_ids=[], content="", tool_calls=[
            CallDelta(index=0, id=c1, name="get_weather"),
            CallDelta(index=0, arguments='{"city": "Pa')]),
        Chunk(rid="r", text="...", token_ids=[], content="", tool_calls=[
            CallDelta(index=0, arguments='ris"}', done=True),
            CallDelta(index=1, id=c2, name="get_weather", arguments='{"city":')]),
        Chunk(rid="r", text="...", token_ids=[], content="", tool_calls=[
            CallDelta(index=1, arguments=' "Oslo"}', done=True)]),
    ]
    calls = [ToolCall(id=c1, name="get_weather", arguments='{"city": "Paris"}'),
             ToolCall(id=c2, name="get_weather", arguments='{"city": "Oslo"}')]
    return chunks, _done("...", calls)


def _sse_events(data: list[bytes]) -> list[dict[str, object]]:
    out = []
    for frame in b"".join(data).split(b"\n\n"):
        if frame:
            kind, payload = frame.split(b"\n", 1)
            obj = json.loads(payload.removeprefix(b"data: "))
            assert kind == b"event: " + obj["type"].encode()
            out.append(obj)
    return out


def test_stream_events_add_up_to_the_non_streamed_blocks() -> None:
    real_anthropic()
    from anthropic.lib.streaming._messages import accumulate_event

    chunks, done = _chunks()
    streamed = BlockWriter(events=True)
    data = [b for c in chunks for b in streamed.feed(c)] + streamed.finish(done)
    plain = BlockWriter(events=False)
    for c in chunks:
        assert plain.feed(c) == []
    plain.finish(done)
    start = {"type": "message_start", "message": {
        "id": "msg_x", "type": "message", "role": "assistant", "content": [], "model": "m",
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 0}}}
    events = _sse_events(data)
    snapshot, bufs = None, {}
    for e in [start, *events]:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    got = [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in snapshot.content]
    assert got == plain.blocks
    assert [b["type"] for b in plain.blocks] == ["thinking", "text", "tool_use", "tool_use"]
    assert plain.blocks[0]["thinking"] == "plan" and plain.blocks[1]["text"] == "Let me check. "
    assert [b["input"] for b in plain.blocks[2:]] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert [b["id"] for b in plain.blocks[2:]] == ["toolu_aa", "toolu_bb"]
    # each block: start, deltas, stop, in order; the input streamed in fragments
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds[0] == ("content_block_start", 0) and kinds[-1] == ("content_block_stop", 3)
    fragments = [e["delta"]["partial_json"] for e in events
                 if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert len(fragments) == 4 and json.loads("".join(fragments[:2])) == {"city": "Paris"}


def test_omitted_thinking_and_a_call_the_output_ended_inside() -> None:
    writer = BlockWriter(events=False, show_thinking=False)
    writer.feed_text("<think>secret</think>answer")
    writer.finish(_done("x"))
    assert writer.blocks[0] == {"type": "thinking", "thinking": "", "signature":
                                writer.blocks[0]["signature"]} and writer.blocks[0]["signature"]
    cut = BlockWriter(events=False)
    cut.feed(Chunk(rid="r", text="x", token_ids=[], content="", tool_calls=[
        CallDelta(index=0, id="call_c", name="f", arguments='{"a": ')]))
    cut.finish(_done("x", reason="length"))
    assert cut.blocks == []  # not a whole object: left out of the non-streamed reply


@pytest.mark.parametrize(("done", "expect"), [
    (_done("x", reason="length", completion=16), ("max_tokens", None)),
    (_done("x", reason="length", completion=3), ("model_context_window_exceeded", None)),
    (_done("x", [ToolCall(id="c", name="f", arguments="{}")]), ("tool_use", None)),
    (_done("x", matched="END"), ("stop_sequence", "END")),
    (_done("x", matched=2), ("end_turn", None))])
def test_stop_reasons(done: Done, expect: tuple[str, str | None]) -> None:
    assert stop_reason(done, ["END"], 16) == expect


# -- holds and accounting -----------------------------------------------------------------------


def test_common_prefix_and_prefix_keys() -> None:
    rng = random.Random(3)
    for _ in range(200):
        a = [rng.randrange(5) for _ in range(rng.randrange(0, 30))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(5))]
        brute = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                     min(len(a), len(b)))
        assert common_prefix(pack(a), pack(b)) == brute
    keys, other = PrefixKeys(pack([1, 2, 3, 4])), PrefixKeys(pack([1, 2, 9]))
    keys.compute([3, 1])
    assert keys.key(2) == other.key(2) and keys.key(3) != other.key(3)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_holds_match_by_tokens_and_expire_after_their_last_use() -> None:
    clock = _Clock()
    holds = PrefixHolds(clock)
    prompt = PrefixKeys(pack(list(range(50))))
    short = Hold("s1", 10, prompt.key(10), 1, 300.0, 0.0)
    long = Hold("s2", 40, prompt.key(40), 3, 300.0, 0.0)
    stranger = Hold("s3", 20, PrefixKeys(pack([7] * 20)).key(20), 2, 300.0, 0.0)
    for h in (short, long, stranger):
        holds.refresh(h)
        assert holds.add(h) is None
    assert holds.matching(prompt) == [long, short]
    clock.t += 200
    holds.refresh(short)  # used: its clock restarts
    clock.t += 150
    assert holds.matching(prompt) == [short]
    assert {h.session for h in holds.expired()} == {"s2", "s3"} and len(holds) == 1


def _prompt(total: int, marks: list[Mark]) -> TokenizedPrompt:
    return TokenizedPrompt(list(range(total)), PrefixKeys(pack(list(range(total)))), marks)


def test_lookback_reads_holds_within_20_blocks_of_a_breakpoint() -> None:
    holds = PrefixHolds(_Clock())
    tc = TenantCache(link=None, holds=holds, renders=None)  # type: ignore[arg-type]
    prompt = _prompt(100, [Mark(90, 300.0, block=30)])
    for session, length, block in (("near", 60, 11), ("far", 70, 10), ("after", 95, 30)):
        hold = Hold(session, length, prompt.keys.key(length), block, 300.0, 0.0)
        holds.refresh(hold)
        holds.add(hold)
    # block 11 is the 20th position counting back from block 30; 10 is beyond; 95 is past
    # the breakpoint's own end
    assert [h.session for h in candidates(tc, prompt)] == ["near"]
    assert predict(prompt, candidates(tc, prompt)) == cache_usage(100, [Mark(90, 300.0, 30)], 60)
    assert candidates(tc, _prompt(100, [])) == []  # no breakpoint: nothing is read


def test_mixed_ttl_accounting_follows_anthropics_three_positions() -> None:
    one_h, five_m = 3600.0, 300.0
    marks = [Mark(1000, one_h, 1), Mark(1500, one_h, 2), Mark(2000, five_m, 3)]
    # A = 0 (no read): 1h writes up to B = 1500, 5m writes from B to C = 2000
    u = cache_usage(2100, marks, 0)
    assert (u.read, u.write_1h, u.write_5m, u.total - u.read - u.written) == (0, 1500, 500, 100)
    # A read at 1000: B - A at the 1h rate, C - B at the 5m rate
    u = cache_usage(2100, marks[1:], 1000)
    assert (u.read, u.write_1h, u.write_5m) == (1000, 500, 500)
    # everything read: no writes, the tail after the last breakpoint is input
    u = cache_usage(2100, [], 2000)
    assert (u.read, u.written, u.json(7)["input_tokens"], u.json(7)["output_tokens"]) == (
        2000, 0, 100, 7)
