"""Tool calls on the frontend side: formats, rendering, call schemas, the checks on tools
(`rules.check_tools`) and tool_choice, and calls read into chunks and Dones with their ids
(tokenizer/tools.py, runtime/rules.py, runtime/frontend/structured.py).

References: transformers' own `apply_chat_template` for rendering, `jsonschema` for the
call schemas, `json` for read arguments, calls written here for what is read.
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
from radixlm.runtime.rules import RequestError, check_tools
from radixlm.tokenizer import ChatTemplate, Tokenizer
from radixlm.tokenizer.tools import (
    call_frame,
    call_schema,
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


def _read(text: str, fmt: str, parallel: bool = True, cuts: tuple[int, ...] = ()) -> tuple:
    """`text` through a branch's call reader (cut at `cuts`): (content, pieces, calls)."""
    reader = plan_structured(gen(tools=TOOLS, parallel_tool_calls=parallel), fmt).reader()  # type: ignore[arg-type]
    assert reader is not None
    content, pieces, pos = "", [], 0
    for cut in [*cuts, len(text)]:
        c, p = reader.read(text[pos:cut], final=cut == len(text))
        for piece in p or []:
            pieces.append((len(content) + piece.at, piece))
        content += c
        pos = cut
    return content, pieces, reader.calls


def test_calls_are_read_in_each_format() -> None:
    text = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>')
    content, _, calls = _read(text, "hermes")
    assert content == "Sure.\n" and calls is not None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lima"}), ("calc", {"expr": "2*3"})]
    _, _, calls = _read('<|python_tag|>{"name": "calc", "parameters": {"expr": "1+2"}}', "llama3")
    assert calls is not None and json.loads(calls[0].arguments) == {"expr": "1+2"}
    generic = ' {"name": "calc", "arguments": {"expr": "7"}}; {"name": "calc", "arguments": {"expr": "8"}}'
    _, _, calls = _read(generic, "generic")
    assert calls is not None and [json.loads(c.arguments)["expr"] for c in calls] == ["7", "8"]
    # Arguments given as a JSON string (some models do) are read as the object they hold.
    _, _, calls = _read('{"name": "calc", "arguments": "{\\"expr\\": \\"9\\"}"}', "generic")
    assert calls is not None and json.loads(calls[0].arguments) == {"expr": "9"}


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "unknown_tool", "arguments": {}}',
    '{"name": "calc", "arguments": [1]}',
])  # fmt: skip
def test_what_is_no_call_stays_content(text: str) -> None:
    assert _read(text, "generic") == (text, [], None)
    hermes = f"<tool_call>{text}</tool_call>"
    assert _read(hermes, "hermes") == (hermes, [], None)


def test_a_call_the_output_ended_inside_streams_but_is_not_listed() -> None:
    content, pieces, calls = _read('{"name": "calc", "arguments": {"expr": ', "generic")
    assert content == "" and calls is None
    assert [(p.name, p.arguments, p.done) for _, p in pieces] == [("calc", '{"expr": ', False)]


@pytest.mark.parametrize("cuts", [(), (1,), (9, 40), (25, 26, 27, 60, 61, 100)])
def test_pieces_carry_one_id_per_call_and_match_the_done(cuts: tuple[int, ...]) -> None:
    text = ('Let me see. <tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call> and '
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    content, pieces, calls = _read(text, "hermes", cuts=cuts)
    assert content == "Let me see. and "
    assert calls is not None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("calc", {"expr": "1"}), ("get_weather", {"city": "Oslo"})]
    ids = {p.index: p.id for _, p in pieces if p.id is not None}
    assert [ids[0], ids[1]] == [c.id for c in calls] and ids[0] != ids[1]
    assert all(i.startswith("call_") for i in ids.values())
    for call_index, call in enumerate(calls):
        mine = [(at, p) for at, p in pieces if p.index == call_index]
        assert mine[0][1].name == call.name  # named by the first piece
        assert "".join(p.arguments for _, p in mine) == call.arguments
        assert [p.done for _, p in mine][-1] and sum(p.done for _, p in mine) == 1
    # each call sits where it was written in the content: after "Let me see. ", "and "
    assert [at for at, p in pieces if p.name] == [len("Let me see. "), len("Let me see. and ")]


def test_parallel_false_keeps_the_first_call() -> None:
    text = '{"name": "calc", "arguments": {"expr": "1"}}\n{"name": "get_weather", "arguments": {"city": "x"}}'
    assert len(_read(text, "generic")[2] or []) == 2
    calls = _read(text, "generic", parallel=False)[2]
    assert calls is not None and [c.name for c in calls] == ["calc"]


def test_call_frame() -> None:
    assert call_frame("hermes") == ("<tool_call>\n", "\n</tool_call>")
    assert call_frame("generic") == call_frame("llama3") == ("", "")


@pytest.mark.parametrize(("tools", "needle", "code"), [
    ([], "tools is empty", ErrorCode.INVALID_PARAMS),
    ([CALC] * 3, "exceed the context length (2)", ErrorCode.TOO_LONG),
    ([Tool(name="bad name!")], "bad name!", ErrorCode.INVALID_PARAMS),
    ([CALC, CALC], "given twice", ErrorCode.INVALID_PARAMS),
    ([Tool(name="f", parameters={"type": "string"})], "must be an object schema", ErrorCode.INVALID_PARAMS),
    ([Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "text"}}})],
     "'text' is not a JSON Schema type", ErrorCode.INVALID_PARAMS),
    ([Tool(name="f", parameters={"properties": {"a": 3}})], "properties.a must be a JSON Schema",
     ErrorCode.INVALID_PARAMS),
    ([Tool(name="f", parameters={"properties": {}, "required": "a"})], "required must be a list",
     ErrorCode.INVALID_PARAMS),
    ([Tool(name="f", parameters={"anyOf": {"type": "object"}})], "anyOf must be a list",
     ErrorCode.INVALID_PARAMS),
])  # fmt: skip
def test_check_tools_names_the_problem(tools: list[Tool], needle: str, code: str) -> None:
    with pytest.raises(RequestError) as e:
        check_tools(tools, context_length=2)
    assert e.value.code == code and needle in e.value.message, e.value.message
    check_tools(None, context_length=2)
    check_tools(TOOLS, context_length=2)


def gen(**kw) -> Generate:
    return Generate(rid="r", input=Input(text="x"), **kw)


@pytest.mark.parametrize(("msg", "needle"), [
    (gen(sampling=SamplingParams(regex="a", json_schema="{}")), "at most one of regex, json_schema"),
    (gen(tools=TOOLS, tool_choice=NamedToolChoice(name="nope")), "'nope', which is not among tools"),
    (gen(tool_choice=NamedToolChoice(name="calc")), "no tools are given"),
    (gen(tool_choice="required"), "needs tools"),
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
    assert plan_structured(gen(tools=TOOLS, tool_choice="none"), "hermes").reader() is None


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
