"""The agent frameworks, unchanged, against `radixlm serve --http` on the embedded
SmolLM2-135M-Instruct (a real chat template and call format): openai-agents (its
Responses and Chat Completions models, tools with ``output_type``, streamed runs, and
``OpenAIConversationsSession``), langchain-openai, pydantic-ai and instructor (in its own
virtual environment: its pins conflict with the `openai` the others need, see the
Makefile).

References: the frameworks' own parsing (a run's final output is their validated
pydantic object), `json` for streamed arguments, and each turn's usage: a continued
turn's ``cached_tokens`` equal the previous turn's input + output (its whole history).
A tool that may run once (disabled after, by each framework's own switch) makes the
second request structured output only, so runs end whatever the small model prefers.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from http_helpers import SMOL_KEY as KEY
from http_helpers import SMOL_MODEL as MODEL
from http_helpers import HttpServer
from pydantic import BaseModel, Field

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Room for a call, its repeat (where the answer ends) or a `Weather`; the grammar ends
# calls and structured output, so free text is what a larger limit would cost.
CALL_TOKENS = 96
REPO = Path(__file__).resolve().parents[2]


class Weather(BaseModel):  # short fields: few tokens to decode on a 2-core CI machine
    city: str = Field(max_length=12)
    summary: str = Field(max_length=16)


class Reply(BaseModel):
    answer: str = Field(max_length=12)


def weather_report(city: str) -> str:
    return f"It is sunny and 21 C in {city}."


def _openai_agents() -> None:
    """Make ``import agents`` the openai-agents package: pytest (importlib mode) registers
    a checkout whose folder is named ``agents`` under that very name."""
    mod = sys.modules.get("agents")
    if mod is not None and not hasattr(mod, "Runner"):
        for name in [n for n in sys.modules if n == "agents" or n.startswith("agents.")]:
            del sys.modules[name]


def _async_client(smol: HttpServer):  # noqa: ANN202
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=smol.base_url, api_key=KEY, max_retries=0)


# -- parallel calls under tool_choice "required" --------------------------------------------

CITY_TOOL = {"name": "get_weather", "description": "Get the weather for a city.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


def test_required_parallel_calls_end_at_a_repeat(smol) -> None:  # noqa: ANN001
    """SmolLM2 under "required" with parallel calls writes the same call again and again;
    the answer ends before the first repeat. Reference: the model's own next call after
    the answer (a plain JSON-schema request over the prompt's and the answer's token ids,
    which the engine does not watch) is one the answer already holds."""
    from radixlm.runtime.protocol import (
        Done,
        Generate,
        Input,
        Message,
        SamplingParams,
        Tokenize,
        Tokens,
        Tool,
    )
    from radixlm.tokenizer.tools import call_schema, generic_tool_prompt

    tool = Tool(**CITY_TOOL)  # type: ignore[arg-type]
    question = [Message(role="user", content="What is the weather in Paris?")]
    with smol.server.client(timeout_s=300) as raw:
        done = raw.call(Generate(rid="calls", input=Input(messages=question), tools=[tool],
                                 tool_choice="required",
                                 sampling=SamplingParams(max_tokens=CALL_TOKENS, temperature=0)))
        assert isinstance(done, Done)
        calls = [(c.name, json.loads(c.arguments)) for c in done.tool_calls or []]
        assert calls and len(set(map(repr, calls))) == len(calls), done.text
        assert done.finish_reason == "stop" and len(done.token_ids) < CALL_TOKENS, done.text
        # The prompt as the generic format shows tools: a system message, then the question.
        shown = [Message(role="system", content=generic_tool_prompt([tool])), *question]
        prompt = raw.call(Tokenize(rid="p", input=Input(messages=shown)))
        assert isinstance(prompt, Tokens) and len(prompt.input_ids) == done.usage.prompt_tokens
        nxt = raw.call(Generate(rid="next", input=Input(input_ids=prompt.input_ids + done.token_ids),
                                sampling=SamplingParams(max_tokens=48, temperature=0,
                                                        json_schema=call_schema([tool], "generic"))))
        assert isinstance(nxt, Done)
    again = json.loads(nxt.text)
    assert (again["name"], again["arguments"]) in calls, (done.text, nxt.text)


def test_required_parallel_calls_keep_the_history_exact(smol) -> None:  # noqa: ANN001
    """The turn that ended at a repeat continues from exactly its kept tokens: the next
    turn of the chain hits its whole history."""
    client = smol.openai()
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[{"type": "function", **CITY_TOOL}],
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=CALL_TOKENS)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.usage.output_tokens < CALL_TOKENS
    assert len({(c.name, c.arguments) for c in calls}) == len(calls)
    results = [{"type": "function_call_output", "call_id": c.call_id,
                "output": weather_report(json.loads(c.arguments)["city"])} for c in calls]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=results,
                                     tools=[{"type": "function", **CITY_TOOL}],
                                     temperature=0, max_output_tokens=4)
    assert second.usage.input_tokens_details.cached_tokens == (first.usage.input_tokens
                                                               + first.usage.output_tokens)
    client.close()


# -- openai-agents ------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "stream"), [("responses", False), ("chat", True)])
def test_openai_agents_tools_with_output_type(smol, kind: str, stream: bool) -> None:  # noqa: ANN001
    _openai_agents()
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather_report(city)

    async def run() -> object:
        client = _async_client(smol)
        model_class = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="You answer weather questions.",
                      tools=[get_weather], output_type=Weather,
                      model=model_class(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=CALL_TOKENS,
                                                   tool_choice="required",
                                                   include_usage=True))  # (streamed chat)
        question = "What is the weather in Paris?"
        if stream:
            result = Runner.run_streamed(agent, question, max_turns=4)
            kinds = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in kinds
        else:
            result = await Runner.run(agent, question, max_turns=4)
        await client.close()
        return result

    result = asyncio.run(run())
    assert len(calls) == 1  # the first request (tools + output_type) answered with the call
    assert isinstance(result.final_output, Weather), result.final_output  # type: ignore[attr-defined]
    usage = result.context_wrapper.usage.request_usage_entries  # type: ignore[attr-defined]
    assert len(usage) == 2


def test_openai_agents_conversations_session(smol) -> None:  # noqa: ANN001
    _openai_agents()
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)

    async def run() -> list[tuple[int, int, int]]:
        client = _async_client(smol)
        # A short structured answer: the grammar ends each turn (free text would run on).
        agent = Agent(name="chat", instructions="Answer briefly.", output_type=Reply,
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=48))
        session = OpenAIConversationsSession(openai_client=client)
        turns = []
        for text in ["My name is Ada.", "What is my name?", "Say it again."]:
            result = await Runner.run(agent, text, session=session)
            u = result.context_wrapper.usage.request_usage_entries[0]
            turns.append((u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens))
        items = await session.get_items()
        assert [i.get("role") for i in items] == ["user", "assistant"] * 3
        # The conversation lives on the server: a new session object reads it back.
        again = OpenAIConversationsSession(conversation_id=session.session_id, openai_client=client)
        assert len(await again.get_items()) == 6
        await session.clear_session()
        await client.close()
        return turns

    turns = asyncio.run(run())
    for (prev_in, _, prev_out), (_, cached, _) in zip(turns, turns[1:], strict=False):
        assert cached == prev_in + prev_out, turns  # each turn computed only its new tokens


# -- langchain-openai -----------------------------------------------------------------------


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_tools_streamed_and_structured(smol, responses_api: bool) -> None:  # noqa: ANN001
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return weather_report(city)

    llm = ChatOpenAI(model=MODEL, base_url=smol.base_url, api_key=KEY, temperature=0,
                     max_tokens=CALL_TOKENS, max_retries=0, use_responses_api=responses_api)
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
    if not responses_api:
        structured = llm.with_structured_output(Weather, method="json_schema")
        assert isinstance(structured.invoke("Weather in Rome: sunny."), Weather)
        # Tools beside a response format: one request, either a call or a Weather.
        both = llm.bind_tools([get_weather], response_format=Weather, strict=True)
        reply = both.invoke("What is the weather in Oslo?")
        assert reply.tool_calls or Weather.model_validate_json(reply.content)


# -- pydantic-ai ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_pydantic_ai_native_output_with_tools(smol, kind: str) -> None:  # noqa: ANN001
    from pydantic_ai import Agent, NativeOutput, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model_class = OpenAIChatModel if kind == "chat" else OpenAIResponsesModel
    model = model_class(MODEL, provider=OpenAIProvider(base_url=smol.base_url, api_key=KEY))
    agent = Agent(model, output_type=NativeOutput(Weather),
                  instructions="You answer weather questions.",
                  model_settings=ModelSettings(temperature=0, max_tokens=CALL_TOKENS))
    calls: list[str] = []

    async def once(ctx: RunContext, tool_def):  # noqa: ANN001, ANN202
        return None if calls else tool_def

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        calls.append(city)
        return weather_report(city)

    result = agent.run_sync("What is the weather in Paris?")
    assert isinstance(result.output, Weather)
    assert result.usage.requests == len(calls) + 1


# -- instructor (its own virtual environment) -----------------------------------------------

INSTRUCTOR_SCRIPT = r"""
import json, os, sys
import instructor, openai
from pydantic import BaseModel, Field

class Weather(BaseModel):
    city: str = Field(max_length=12)
    summary: str = Field(max_length=16)

base = openai.OpenAI(base_url=os.environ["BASE_URL"], api_key=os.environ["API_KEY"],
                     max_retries=0)
out = {}
for mode in ("RESPONSES_TOOLS", "TOOLS", "JSON_SCHEMA"):
    client = instructor.from_openai(base, mode=getattr(instructor.Mode, mode))
    if mode == "RESPONSES_TOOLS":
        w = client.responses.create(model=os.environ["MODEL"], input="Weather in Rome: sunny.",
                                    response_model=Weather, temperature=0,
                                    max_output_tokens=120, max_retries=0)
    else:
        w = client.chat.completions.create(
            model=os.environ["MODEL"], response_model=Weather, temperature=0, max_tokens=120,
            max_retries=0, messages=[{"role": "user", "content": "Weather in Rome: sunny."}])
    out[mode] = w.model_dump()
print(json.dumps({"version": instructor.__version__, "results": out}))
"""


def _instructor_python() -> Path | None:
    given = os.environ.get("RADIXLM_INSTRUCTOR_PYTHON")
    path = Path(given) if given else REPO / ".venv-instructor" / "bin" / "python"
    return path if path.exists() else None


def test_instructor_modes(smol) -> None:  # noqa: ANN001
    python = _instructor_python()
    if python is None:
        pytest.skip("no .venv-instructor (made by `make install`: instructor pins jiter<0.15, "
                    "which the openai of the main venv cannot use)")
    env = {**os.environ, "BASE_URL": smol.base_url, "API_KEY": KEY, "MODEL": MODEL}
    run = subprocess.run([str(python), "-c", INSTRUCTOR_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])["results"]
    assert set(results) == {"RESPONSES_TOOLS", "TOOLS", "JSON_SCHEMA"}
    for value in results.values():
        Weather.model_validate(value)
