"""ChatTemplate against transformers' apply_chat_template on public template families, and
render_delta's contract: ``render(history) + render_delta(new) == render(history + new)``."""

from __future__ import annotations

import dataclasses
import random

import jinja2
import pytest
from radixlm.tokenizer import ChatTemplate, ChatTemplateError

# Qwen2.5-Instruct (ChatML with tools; injects a default system prompt).
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3 Instruct (BOS inside the template, content trimmed).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral Instruct v0.1 (strict user/assistant alternation, no system role, EOS per reply).
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)

# Gemma 2 (rejects system messages, alternation, "model" role).
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# Qwen3-style reasoning: the <think> block of assistant turns before the last user query is
# dropped, so appending a user turn re-renders the previous reply (no prefix property).
QWEN3_LIKE = """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is defined else '' %}
        {%- if loop.index0 > ns.last_query %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# transformers' template conventions in one template: trim/lstrip blocks, loop controls,
# namespace, dict(), tojson options and no HTML escaping, strftime_now, {% generation %}.
FEATURES = """{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message.role) }}
    {% endif %}
    {% if message.content == 'skip me' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message.role == 'assistant' %}
<{{ message.role }}>{% generation %}{{ message.content }}{% endgeneration %}</s>
    {% else %}
<{{ message.role }}>{{ message.content }}
    {% endif %}
    {% if message.content == 'stop here' %}{% break %}{% endif %}
{% endfor %}
{% if tools %}TOOLS {{ tools | tojson(indent=2) }}
{% endif %}
{% set d = dict(a=1, b='x') %}
META {{ d | tojson }} {{ ns.count }} {{ strftime_now('%Y') }} {{ 'é<>&"' | tojson }} {{ {'k': 'é'} | tojson(ensure_ascii=True, sort_keys=True) }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

BOS, EOS = "<s>", "</s>"


@pytest.fixture(scope="module")
def hf():
    """A minimal transformers tokenizer: apply_chat_template only needs its special tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"<unk>": 0, BOS: 1, EOS: 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOS, unk_token="<unk>"
    )


def reference(hf, template: str, conv, gen=False, **kwargs) -> str:
    return hf.apply_chat_template(
        conv, chat_template=template, tokenize=False, add_generation_prompt=gen, **kwargs
    )


def make(template: str) -> ChatTemplate:
    return ChatTemplate(
        template, bos_token=BOS, eos_token=EOS, extra_context={"unk_token": "<unk>"}
    )


# -- random conversations each template accepts --------------------------------------------

_TEXT = ["hi", " there", "日本", "🤖", "  pad  ", "\n", "x", "What's 2+2?", "4.", "ok"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choices(_TEXT, k=rng.randint(1, 4)))


def _chat(rng: random.Random, system: bool) -> list[dict]:
    conv = [{"role": "system", "content": _text(rng)}] if system and rng.random() < 0.5 else []
    for turn in range(rng.randint(1, 6)):
        conv.append({"role": "user" if turn % 2 == 0 else "assistant", "content": _text(rng)})
    return conv


def _tool_chat(rng: random.Random) -> list[dict]:
    conv = _chat(rng, system=True)
    if conv[-1]["role"] == "assistant":
        conv.append({"role": "user", "content": _text(rng)})
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
        for c in rng.sample(["Paris", "東京", "Lima"], k=rng.randint(1, 2))
    ]
    conv.append(
        {"role": "assistant", "content": rng.choice(["", "Let me check."]), "tool_calls": calls}
    )
    conv.extend({"role": "tool", "content": f"sunny {i}"} for i in range(len(calls)))
    conv.append({"role": "assistant", "content": _text(rng)})
    return conv


CASES = {
    "qwen25": (QWEN25, lambda rng: _chat(rng, system=True)),
    "qwen25-tools": (QWEN25, _tool_chat),
    "llama3": (LLAMA3, lambda rng: _chat(rng, system=True)),
    "mistral": (MISTRAL, lambda rng: _chat(rng, system=False)),
    "gemma2": (GEMMA2, lambda rng: _chat(rng, system=False)),
}


@pytest.mark.parametrize("name", CASES)
def test_render_matches_transformers(hf, name):
    template, gen_conv = CASES[name]
    ct = make(template)
    rng = random.Random(name)
    for _ in range(25):
        conv = gen_conv(rng)
        gen = conv[-1]["role"] == "user" and rng.random() < 0.7
        tools = TOOLS if name == "qwen25-tools" and rng.random() < 0.7 else None
        assert ct.render(conv, add_generation_prompt=gen, tools=tools) == reference(
            hf, template, conv, gen, tools=tools
        )


@pytest.mark.parametrize("name", CASES)
def test_render_delta_appends(name):
    """For every split whose history the full render keeps as a prefix, history + delta is
    the full render, with a placeholder history and with the real one."""
    template, gen_conv = CASES[name]
    ct = make(template)
    rng = random.Random(f"delta-{name}")
    checked = 0
    for _ in range(25):
        conv = gen_conv(rng)
        gen = conv[-1]["role"] == "user" and rng.random() < 0.7
        tools = TOOLS if name == "qwen25-tools" and rng.random() < 0.7 else None
        full = ct.render(conv, add_generation_prompt=gen, tools=tools)
        assert (
            ct.render_delta(conv, add_generation_prompt=gen, has_history=False, tools=tools) == full
        )
        for k in range(1, len(conv) + 1):
            history, new = conv[:k], conv[k:]
            prefix = ct.render(history, tools=tools)
            if not full.startswith(prefix):
                # Only consecutive tool results merge into one block (Qwen2.5): no append.
                assert new[0]["role"] == "tool" and history[-1]["role"] == "tool"
                with pytest.raises(ChatTemplateError):
                    ct.render_delta(new, add_generation_prompt=gen, history=history, tools=tools)
                continue
            assert (
                prefix
                + ct.render_delta(new, add_generation_prompt=gen, history=history, tools=tools)
                == full
            )
            if new and history[-1]["role"] != "tool":
                assert prefix + ct.render_delta(new, add_generation_prompt=gen, tools=tools) == full
            checked += 1
    assert checked > 40


@pytest.mark.parametrize(
    ("template", "gen_prompt", "end"),
    [
        (QWEN25, "<|im_start|>assistant\n", "<|im_end|>\n"),
        (LLAMA3, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
        (MISTRAL, "", EOS),
        (GEMMA2, "<start_of_turn>model\n", "<end_of_turn>\n"),
    ],
)
def test_generation_prompt_and_assistant_end(template, gen_prompt, end):
    ct = make(template)
    assert ct.generation_prompt() == gen_prompt
    assert ct.assistant_end() == end
    # A session closes a generated reply with assistant_end, then appends the next turn:
    # the result is exactly the full render.
    reply = "The answer is 4."
    user = [{"role": "user", "content": "What is 2+2?"}]
    session = ct.render_delta(user, add_generation_prompt=True, has_history=False) + reply
    session += ct.assistant_end()
    nxt = [{"role": "user", "content": "Thanks"}]
    session += ct.render_delta(nxt, add_generation_prompt=True)
    conv = [*user, {"role": "assistant", "content": reply}, *nxt]
    assert session == ct.render(conv, add_generation_prompt=True)


def test_qwen25_tool_results_delta():
    ct = make(QWEN25)
    delta = ct.render_delta(
        [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rainy"}],
        add_generation_prompt=True,
    )
    assert delta == (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
        "rainy\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_reasoning_template_anchor_rule(hf):
    ct = make(QWEN3_LIKE)
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 plus 2"},
    ]
    new = [{"role": "user", "content": "and 3+3?"}]
    full = ct.render(history + new, add_generation_prompt=True)
    assert full == reference(hf, QWEN3_LIKE, history + new, True)
    # The history render keeps the <think> block, the longer conversation drops it...
    assert not full.startswith(ct.render(history))
    # ...so the delta is what follows the reply's closing markup, not a plain suffix diff.
    expected = "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    assert full.endswith(expected)
    assert ct.render_delta(new, add_generation_prompt=True) == expected
    assert ct.render_delta(new, add_generation_prompt=True, history=history) == expected
    assert (
        ct.generation_prompt(enable_thinking=False)
        == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert ct.assistant_end() == "<|im_end|>\n"


def test_reasoning_field_aliases_match_transformers(hf):
    ct = make(QWEN3_LIKE)
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "thought"},
    ]
    assert ct.render(conv) == reference(hf, QWEN3_LIKE, conv)
    assert "thought" in ct.render(conv)


def test_transformers_conventions_match(hf):
    ct = make(FEATURES)
    conv = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "skip me"},
        {"role": "user", "content": "hello <b>&</b>"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "stop here"},
        {"role": "assistant", "content": "never rendered"},
    ]
    for gen in (False, True):
        for tools in (None, TOOLS):
            out = ct.render(conv, add_generation_prompt=gen, tools=tools)
            assert out == reference(hf, FEATURES, conv, gen, tools=tools)
    assert "never rendered" not in out and "skip me" not in out
    assert '"é<>&\\""' in out  # tojson does not HTML-escape


def test_raise_exception_and_sandbox_match(hf):
    ct = make(FEATURES)
    bad = [{"role": "robot", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role: robot"):
        ct.render(bad)
    with pytest.raises(jinja2.TemplateError, match="unknown role: robot"):
        reference(hf, FEATURES, bad)
    sneaky = "{% set ns = namespace(_secret=1) %}{{ ns._secret }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        make(sneaky).render([{"role": "user", "content": "x"}])
    escape = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        make(escape).render([{"role": "user", "content": "x"}])


def test_special_tokens_and_kwargs_reach_the_template(hf):
    t = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ custom }}|{{ messages | length }}"
    conv = [{"role": "user", "content": "x"}]
    assert (
        make(t).render(conv, custom=7) == reference(hf, t, conv, custom=7) == "<s>|</s>|<unk>|7|1"
    )
    assert make(t).render(conv, bos_token="B") == reference(hf, t, conv, bos_token="B")


@dataclasses.dataclass
class _Msg:
    role: str
    content: str
    name: str | None = None


def test_messages_as_structs_and_dataclasses():
    ct = make(QWEN25)
    dicts = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert ct.render([_Msg("user", "hi"), _Msg("assistant", "yo")]) == ct.render(dicts)
    protocol = pytest.importorskip("radixlm.runtime.protocol")
    structs = [
        protocol.Message(role="user", content="hi"),
        protocol.Message(role="assistant", content="yo"),
    ]
    assert ct.render(structs) == ct.render(dicts)
    assert ct.render_delta(structs[1:], history=structs[:1]) == ct.render_delta(dicts[1:])


def test_none_fields_are_dropped_like_transformers(hf):
    conv = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "tool_calls": None},
    ]
    assert make(QWEN25).render(conv) == reference(hf, QWEN25, conv)


def test_delta_errors_are_clear():
    ct = make(MISTRAL)
    with pytest.raises(ChatTemplateError, match="cannot render"):
        ct.render_delta([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_empty_delta():
    ct = make(QWEN25)
    assert ct.render_delta([]) == ""
    assert ct.render_delta([], add_generation_prompt=True) == "<|im_start|>assistant\n"
