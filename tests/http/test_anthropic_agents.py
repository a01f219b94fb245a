"""Agent code written for Claude, unchanged, against `radixlm serve` on the embedded
SmolLM2-135M-Instruct (a real chat template and call format): the `anthropic` SDK (a
tool loop, its own tool runner, a multi-turn agent loop with ``cache_control`` on the
system prompt and the last message), langchain-anthropic (`ChatAnthropic`: invoke,
stream, `bind_tools`, `with_structured_output` both ways) and pydantic-ai's Anthropic
model (tools with tool output, and native structured output) -- the twins of
test_agents.py.

References: the frameworks' own parsing (their validated pydantic objects), `json` for
streamed arguments, the token counts the server reports for the same text (a turn reads
all of its history but what the last turn added), and the engine's own tokenization.
A tool that may run once makes the request after it structured output only, so runs end
whatever the small model prefers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from http_helpers import SMOL_KEY as KEY
from http_helpers import SMOL_MODEL as MODEL
from http_helpers import real_anthropic
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CALL_TOKENS = 96
CC = {"type": "ephemeral"}
# The SDK's newest API version has no sampling options; this one keeps temperature.
OLD_API = {"anthropic-version": "2023-06-01"}
CITY_TOOL = {"name": "get_weather", "description": "Get the weather for a city.",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                        "maxLength": 12}},
                              "required": ["city"], "additionalProperties": False}}


class Weather(BaseModel):  # short fields: few tokens to decode on a 2-core CI machine
    city: str = Field(max_length=12)
    summary: str = Field(max_length=16)


class Report(BaseModel):  # for structured outputs, whose schemas lose maxLength (Anthropic's
    city: Literal["Rome", "Paris", "Oslo"]  # SDKs move it to a description): short anyway
    sunny: bool


def weather_report(city: str) -> str:
    return f"It is sunny and 21 C in {city}."


def _claude(smol):  # noqa: ANN001, ANN202
    return real_anthropic().Anthropic(base_url=smol.url, api_key=KEY, max_retries=0)


# -- the anthropic SDK ------------------------------------------------------------------------


def test_a_tool_loop_then_structured_output(smol) -> None:  # noqa: ANN001
    claude = _claude(smol)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(model=MODEL, max_tokens=CALL_TOKENS, tools=[CITY_TOOL],
                                   tool_choice={"type": "any"}, messages=messages,
                                   extra_body={"temperature": 0})
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and calls
    assert len({json.dumps(c.input) for c in calls}) == len(calls)  # ended at a repeat
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                               "content": weather_report(c.input["city"])}
                                              for c in calls]}]
    fmt = {"format": {"type": "json_schema", "schema": Weather.model_json_schema()}}
    answer = claude.messages.create(model=MODEL, max_tokens=CALL_TOKENS, tools=[CITY_TOOL],
                                    tool_choice={"type": "none"}, output_config=fmt,
                                    messages=messages, extra_body={"temperature": 0})
    assert answer.stop_reason == "end_turn"
    Weather.model_validate_json(answer.content[0].text)
    claude.close()


def test_the_sdks_tool_runner(smol) -> None:  # noqa: ANN001
    anthropic = real_anthropic()
    calls: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Get the weather for a city.

        Args:
            city: the city.
        """
        calls.append(city)
        return weather_report(city)

    claude = _claude(smol)
    runner = claude.beta.messages.tool_runner(
        model=MODEL, max_tokens=CALL_TOKENS, tools=[get_weather], max_iterations=2,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        extra_body={"temperature": 0})
    replies = list(runner)
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use"]
    assert len(calls) == 2 and all(isinstance(c, str) and c for c in calls)
    claude.close()


def test_a_cached_agent_loop_reads_all_its_history(smol) -> None:  # noqa: ANN001
    """cache_control on the system prompt and on the last message, the breakpoint moving
    each turn: each turn reads what the previous one read and wrote (its whole prompt up
    to its last message) and only the last reply, the new message and the header are
    not read."""
    anthropic = real_anthropic()

    def new_tokens(text: str) -> int:  # the text alone, by the engine's tokenizer
        status, body = smol.request("POST", "/v1/tokenize",
                                    json.dumps({"prompt": text}).encode())
        assert status == 200
        return body["count"]

    async def run() -> list[tuple[int, int, int, int]]:
        claude = anthropic.AsyncAnthropic(base_url=smol.url, api_key=KEY, max_retries=0)
        system = [{"type": "text", "text": "You answer questions about the weather, briefly.",
                   "cache_control": CC}]
        history: list[dict] = []
        turns = []
        for i, text in enumerate(["What is the weather in Paris?", "And in Rome?",
                                  "Which is warmer?"]):
            for m in history:
                for block in m["content"]:
                    block.pop("cache_control", None)
            history.append({"role": "user", "content": [{"type": "text", "text": text,
                                                         "cache_control": CC}]})
            kw = dict(model=MODEL, max_tokens=24, system=system, tools=[CITY_TOOL],
                      messages=history, extra_body={"temperature": 0})
            if i == 1:  # streamed, as agents stream
                async with claude.messages.stream(**kw) as s:
                    r = await s.get_final_message()
            else:
                r = await claude.messages.create(**kw)
            u = r.usage
            turns.append((u.cache_read_input_tokens, u.cache_creation_input_tokens,
                          u.input_tokens, u.output_tokens + new_tokens(text)))
            content = [b.model_dump(exclude_none=True) for b in r.content if b.type == "text"]
            history.append({"role": "assistant", "content": content or [
                {"type": "text", "text": "ok"}]})
        await claude.close()
        return turns

    turns = asyncio.run(run())
    assert turns[0][0] == 0 and turns[0][1] > 0
    for (prev_read, prev_written, _, _), (read, written, rest, added) in zip(
            turns, turns[1:], strict=False):
        assert read == prev_read + prev_written, turns  # the whole previous prompt
        # not read: the last reply and the new message, their markup and the header
        assert added <= written + rest <= added + 16, turns


# -- langchain-anthropic -------------------------------------------------------------------


def test_langchain_tools_streamed_and_structured(smol) -> None:  # noqa: ANN001
    real_anthropic()
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return weather_report(city)

    llm = ChatAnthropic(model=MODEL, base_url=smol.url, api_key=KEY, temperature=0,
                        max_tokens=CALL_TOKENS, max_retries=0, default_headers=OLD_API)
    assert isinstance(llm.invoke("Say hi.").content, str)
    bound = llm.bind_tools([get_weather], tool_choice="any")
    chunks = list(bound.stream("What is the weather in Paris?"))
    fragments = [tc for c in chunks for tc in c.tool_call_chunks if tc.get("args")]
    assert len(fragments) > 1  # the arguments streamed in pieces
    merged = chunks[0]
    for c in chunks[1:]:
        merged = merged + c
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
    args = merged.tool_calls[0]["args"]
    assert set(args) == {"city"} and isinstance(args["city"], str)
    assert json.loads("".join(tc["args"] for tc in fragments)) == args
    from langchain_core.messages import HumanMessage

    counted = llm.get_num_tokens_from_messages(  # the server's count_tokens
        [HumanMessage("What is the weather in Paris?")], tools=[get_weather])
    assert merged.usage_metadata["input_tokens"] == counted
    assert isinstance(llm.with_structured_output(Weather).invoke("Weather in Rome: sunny."),
                      Weather)
    structured = llm.with_structured_output(Report, method="json_schema")
    assert isinstance(structured.invoke("Weather in Rome: sunny."), Report)


# -- pydantic-ai ------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [False, True])
def test_pydantic_ai_output_with_tools(smol, native: bool) -> None:  # noqa: ANN001
    real_anthropic()
    from pydantic_ai import Agent, NativeOutput, RunContext
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.profiles.anthropic import AnthropicModelProfile
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.settings import ModelSettings

    # radixlm constrains output to a JSON schema: say so (pydantic-ai knows Claude's names)
    profile = AnthropicModelProfile(supports_json_schema_output=True) if native else None
    model = AnthropicModel(MODEL, provider=AnthropicProvider(base_url=smol.url, api_key=KEY),
                           profile=profile)
    output = NativeOutput(Report) if native else Weather
    agent = Agent(model, output_type=output, instructions="You answer weather questions.",
                  model_settings=ModelSettings(temperature=0, max_tokens=CALL_TOKENS,
                                               extra_headers=OLD_API))
    calls: list[str] = []

    async def once(ctx: RunContext, tool_def):  # noqa: ANN001, ANN202
        return None if calls else tool_def

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather_report(city)

    result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, Report if native else Weather)
    assert result.usage.requests >= 1 and result.usage.input_tokens > 0
