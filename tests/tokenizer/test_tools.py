"""Tool calls on the frontend side: formats, rendering, call schemas, parsing, and the
checks on tools / tool_choice (tokenizer/tools.py, runtime/frontend/structured.py).

References: transformers' own `apply_chat_template` for rendering, `jsonschema` for the
call schemas, `json` for parsed arguments.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from radixlm.runtime.frontend.prepare import TextModel, input_ids
from radixlm.runtime.frontend.structured import plan_structured
from radixlm.runtime.protocol import (
    ErrorCode,
    Generate,
    Input,
    Message,
    NamedToolChoice,
    SamplingParams,
    Tool,
    ToolCall,
)
from radixlm.runtime.rules import RequestError
from radixlm.tokenizer import ChatTemplate, Tokenizer
from radixlm.tokenizer.tools import (
    call_frame,
    call_schema,
    check_tools,
    parse_tool_calls,
    template_messages,
    tool_dicts,
    tool_format,
)

from tests.tokenizer.test_chat_templates import BOS, EOS, LLAMA3, QWEN25, hf, reference  # noqa: F401

WEATHER = Tool(name="get_weather", description="Weather in a city", parameters={
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
})  # fmt: skip
CALC = Tool(name="calc", parameters={
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]})
TOOLS = [WEATHER, CALC]
# A Llama 3.1-style template fragment: tools rendered, calls as {"name", "parameters"}.
LLAMA31 = (
    "{% if tools %}{{ 'Tools: ' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "{{ 'Respond with {\"name\": function name, \"parameters\": dictionary}.' }}{% endif %}"
    + LLAMA3
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_formats_follow_the_template() -> None:
    assert tool_format(QWEN25) == "hermes"
    assert tool_format(LLAMA31) == "llama3"
    assert tool_format(CHATML) == "generic"
    assert tool_format(None) == "generic"


def conversation() -> list[Message]:
    return [
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", tool_calls=[
            ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
        Message(role="tool", content="sunny", tool_call_id="call_1", name="get_weather"),
    ]  # fmt: skip


def test_hermes_render_matches_transformers(hf) -> None:  # noqa: F811
    """Protocol messages with tool calls + protocol tools render as transformers renders
    the same conversation in OpenAI's shape."""
    ours = ChatTemplate(QWEN25, bos_token=BOS, eos_token=EOS).render(
        template_messages(conversation(), "hermes", TOOLS, with_tools_prompt=True),
        add_generation_prompt=True, tools=tool_dicts(TOOLS))
    openai_conv = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]  # fmt: skip
    assert ours == reference(hf, QWEN25, openai_conv, True, tools=tool_dicts(TOOLS))
    assert '"name": "get_weather"' in ours and "<tools>" in ours


def test_generic_format_adds_a_tool_prompt_and_writes_calls_as_json() -> None:
    msgs = template_messages(conversation(), "generic", TOOLS, with_tools_prompt=True)
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    # An existing system message gets the tool prompt appended; a later turn gets none.
    with_sys = template_messages([Message(role="system", content="Be brief.")], "generic",
                                 TOOLS, with_tools_prompt=True)
    assert len(with_sys) == 1 and with_sys[0]["content"].startswith("Be brief.\n\n")
    later = template_messages([Message(role="user", content="hi")], "generic", TOOLS,
                              with_tools_prompt=False)
    assert later == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "generic"])
def test_call_schema_accepts_valid_calls_only(fmt: str) -> None:
    key = "parameters" if fmt == "llama3" else "arguments"
    schema = json.loads(call_schema(TOOLS, fmt))  # type: ignore[arg-type]
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", key: {"city": "Oslo", "unit": "c"}},
          {"name": "calc", key: {"expr": "1+1"}}]
    bad = [{"name": "get_weather", key: {"unit": "c"}},  # city missing
           {"name": "calc", key: {"city": "Oslo"}},  # expr missing
           {"name": "nope", key: {}},
           {"name": "calc"},
           {"name": "calc", key: {"expr": "1"}, "extra": 1}]  # fmt: skip
    for call in ok:
        jsonschema.validate(call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    named = json.loads(call_schema([CALC], fmt))  # type: ignore[arg-type]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[0], named)


def test_parse_hermes_llama3_and_generic() -> None:
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>')
    calls = parse_tool_calls(text, "hermes", TOOLS)
    assert calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima"}), ("calc", {"expr": "2*3"})]
    llama = '<|python_tag|>{"name": "calc", "parameters": {"expr": "1+2"}}'
    calls = parse_tool_calls(llama, "llama3", TOOLS)
    assert calls is not None and json.loads(calls[0].arguments) == {"expr": "1+2"}
    generic = ' {"name": "calc", "arguments": {"expr": "7"}}; {"name": "calc", "arguments": {"expr": "8"}}'
    calls = parse_tool_calls(generic, "generic", TOOLS)
    assert calls is not None and [json.loads(c.arguments)["expr"] for c in calls] == ["7", "8"]
    # Arguments given as a JSON string (some models do) are read as the object they hold.
    calls = parse_tool_calls('{"name": "calc", "arguments": "{\\"expr\\": \\"9\\"}"}', "generic", TOOLS)
    assert calls is not None and json.loads(calls[0].arguments) == {"expr": "9"}


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "unknown_tool", "arguments": {}}',
    '{"name": "calc", "arguments": {"expr": ',
    '{"name": "calc", "arguments": [1]}',
    '{"name": "calc", "arguments": {}} and then some prose',
])  # fmt: skip
def test_parse_refuses_non_calls(text: str) -> None:
    assert parse_tool_calls(text, "generic", TOOLS) is None
    assert parse_tool_calls(f"<tool_call>{text}</tool_call>", "hermes", TOOLS) is None


def test_call_frame() -> None:
    assert call_frame("hermes") == ("<tool_call>\n", "\n</tool_call>")
    assert call_frame("generic") == call_frame("llama3") == ("", "")


@pytest.mark.parametrize(("tools", "needle"), [
    ([Tool(name="bad name!")], "bad name!"),
    ([CALC, CALC], "given twice"),
    ([Tool(name="f", parameters={"type": "string"})], "must be an object schema"),
    ([Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "text"}}})],
     "'text' is not a JSON Schema type"),
    ([Tool(name="f", parameters={"properties": {"a": 3}})], "properties.a must be a JSON Schema"),
    ([Tool(name="f", parameters={"properties": {}, "required": "a"})], "required must be a list"),
    ([Tool(name="f", parameters={"anyOf": {"type": "object"}})], "anyOf must be a list"),
])  # fmt: skip
def test_check_tools_names_the_problem(tools: list[Tool], needle: str) -> None:
    problem = check_tools(tools)
    assert problem is not None and needle in problem, problem


def gen(**kw) -> Generate:
    return Generate(rid="r", input=Input(text="x"), **kw)


@pytest.mark.parametrize(("msg", "needle"), [
    (gen(sampling=SamplingParams(regex="a", json_schema="{}")), "at most one of regex, json_schema"),
    (gen(tools=TOOLS, tool_choice=NamedToolChoice(name="nope")), "'nope', which is not among tools"),
    (gen(tool_choice=NamedToolChoice(name="calc")), "no tools are given"),
    (gen(tool_choice="required"), "needs tools"),
    (gen(tools=[]), "tools is empty"),
    (gen(tools=[Tool(name="f", parameters={"type": "array"})]), "must be an object schema"),
])  # fmt: skip
def test_plan_refuses_bad_tool_requests(msg: Generate, needle: str) -> None:
    with pytest.raises(RequestError) as e:
        plan_structured(msg, "hermes")
    assert e.value.code == ErrorCode.INVALID_PARAMS and needle in e.value.message


def test_plan_for_each_choice() -> None:
    assert plan_structured(gen(), "generic").grammar is None
    auto = plan_structured(gen(tools=TOOLS), "hermes")
    assert auto.grammar is None and auto.parse_calls
    assert not plan_structured(gen(tools=TOOLS, tool_choice="none"), "hermes").parse_calls
    named = plan_structured(gen(tools=TOOLS, tool_choice=NamedToolChoice(name="calc")), "hermes")
    assert named.grammar is not None and named.grammar.begin == "<tool_call>\n"
    assert json.loads(named.grammar.text)["properties"]["name"] == {"const": "calc"}
    own = plan_structured(gen(sampling=SamplingParams(regex="[0-9]+")), "generic")
    assert own.grammar is not None and (own.grammar.kind, own.grammar.text) == ("regex", "[0-9]+")
    calls = auto.tool_calls('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>')
    assert calls is not None and calls[0].name == "calc" and calls[0].id.startswith("call_")


def test_prompt_with_tools_on_a_template_without_tool_support(tiny_tokenizer_dir: str) -> None:
    """The tiny model's ChatML template has no tool support: the generic tool prompt is
    rendered as a system message at the start of a sequence."""
    tok = Tokenizer.load(tiny_tokenizer_dir)
    model = TextModel(tokenizer=tok, context_length=4096, vocab_size=tok.vocab_size)
    assert model.tool_format == "generic"
    inp = Input(messages=[Message(role="user", content="2+2?")])
    ids = input_ids(model, inp, tools=[CALC])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "calc"' in text and text.endswith("<|im_start|>assistant\n")
