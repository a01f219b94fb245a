"""``cache_control`` held as KV, end to end: what a request reads and writes by Anthropic's
rules, a multi-turn agent loop that reads its whole previous conversation each turn, the
20-block lookback, mixed TTLs, a held prefix that survives another tenant's flood, holds
that are their tenant's own, a write beyond the tenant's quota, and the bounds of the
shared routes.

One server of its own (a pool small enough to flood, a retention quota per tenant), and
one API key -- one tenant, one set of holds -- per test, so that each test's holds are
its own. References: the HF tokenizer (where a breakpoint's prefix ends: the tiny model's
ChatML template renders each message whole, so a prefix is the render of the messages up
to it without a generation header) and the engine's own ``cached_tokens`` as the chat
completions route reports them (what the pool really holds).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_pool_clean, start_test_server
from http_helpers import HttpServer, free_port, real_anthropic

pytestmark = pytest.mark.timeout(240)

KEYS = [f"cache-key-{i}" for i in range(8)]
POOL = 6144  # tokens: the flood below is larger
QUOTA = 1000  # --max-retained-per-tenant
CAP = 4608  # --retained-cap: room for every test's holds (they last the module)
CC = {"type": "ephemeral"}
SYSTEM = "You are a careful assistant for a hardware shop. " * 12  # ~120 words


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, http_model_dir: Path) -> Iterator[HttpServer]:
    port = free_port()
    keys = [x for k in KEYS for x in ("--api-key", k)]
    with start_test_server(tmp_path_factory.mktemp("anthropic-cache"), http_model_dir,
                           "--http", f"127.0.0.1:{port}", "--kv-tokens", str(POOL),
                           "--max-retained-per-tenant", str(QUOTA), "--retained-cap", str(CAP), "--max-tools", "2",
                           "--max-parts", "30", *keys) as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name, http_model_dir)


def _client(server: HttpServer, key: str) -> Any:
    return real_anthropic().Anthropic(base_url=server.url, api_key=key, max_retries=0)


def _hf_len(server: HttpServer, messages: list[dict[str, str]], header: bool) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server.model_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=header, tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _usage(r: Any) -> tuple[int, int, int]:
    u = r.usage
    return u.cache_read_input_tokens, u.cache_creation_input_tokens, u.input_tokens


def _pool_clean(server: HttpServer) -> None:
    with server.server.client(timeout_s=60) as raw:
        assert_pool_clean(raw)


def test_a_breakpoint_is_written_then_read(server: HttpServer) -> None:
    claude = _client(server, KEYS[0])
    system = [{"type": "text", "text": SYSTEM, "cache_control": CC}]
    held = _hf_len(server, [{"role": "system", "content": SYSTEM}], header=False)
    for i, expect_read in enumerate((0, held, held)):
        question = f"Question {i}: {uuid.uuid4().hex[:6]}?"
        r = claude.messages.create(model=server.model, max_tokens=4, system=system,
                                   messages=[{"role": "user", "content": question}],
                                   extra_body={"temperature": 0})
        total = _hf_len(server, [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": question}], header=True)
        read, created, rest = _usage(r)
        assert (read, created) == (expect_read, held - expect_read), r.usage
        assert read + created + rest == total
        assert r.usage.cache_creation.ephemeral_5m_input_tokens == created
    # the same prefix without a breakpoint reads nothing (Anthropic's rule), though the
    # engine serves it from the cache all the same
    plain = claude.messages.create(model=server.model, max_tokens=2, system=SYSTEM,
                                   messages=[{"role": "user", "content": "Another?"}])
    assert _usage(plain)[:2] == (0, 0)
    claude.close()
    _pool_clean(server)


def test_an_agent_loop_reads_its_whole_previous_conversation(server: HttpServer) -> None:
    """cache_control on the system prompt and on the last message, as agents place them:
    each turn reads the previous turn's whole prompt (up to its last message) and writes
    only what the turn added."""
    claude = _client(server, KEYS[1])
    system = [{"type": "text", "text": SYSTEM, "cache_control": CC}]
    history: list[dict[str, Any]] = []  # as sent (blocks)
    plain: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]  # for HF
    previous_prefix = 0
    for turn, question in enumerate(["Do you sell saws?", "Which is cheapest?",
                                     "Is it in stock?", "Can I order two?"]):
        # the breakpoint moves to the new last message; earlier ones lose theirs
        for m in history:
            if isinstance(m["content"], list):
                m["content"] = [{k: v for k, v in b.items() if k != "cache_control"}
                                for b in m["content"]]
        history.append({"role": "user", "content": [{"type": "text", "text": question,
                                                     "cache_control": CC}]})
        plain.append({"role": "user", "content": question})
        kw = dict(model=server.model, max_tokens=8, system=system, messages=history,
                  extra_body={"temperature": 0})
        if turn == 2:  # streamed: message_start says what message_delta confirms
            body = json.dumps({**kw, "stream": True, "temperature": 0, "extra_body": None})
            status, text = server.request("POST", "/v1/messages", body.encode(), key=KEYS[1])
            assert status == 200
            events = [json.loads(f.split("\ndata: ", 1)[1]) for f in text.strip().split("\n\n")]
            start = events[0]["message"]["usage"]
            delta = next(e for e in events if e["type"] == "message_delta")["usage"]
            for field in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
                assert start[field] == delta[field], (start, delta)
            read, created, rest = (delta["cache_read_input_tokens"],
                                   delta["cache_creation_input_tokens"], delta["input_tokens"])
            reply = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
        else:
            r = claude.messages.create(**kw)
            read, created, rest = _usage(r)
            reply = r.content[0].text if r.content else ""
        prefix = _hf_len(server, plain, header=False)  # this turn's prompt up to its last message
        total = _hf_len(server, plain, header=True)
        assert read == (previous_prefix if turn else 0), (turn, read, previous_prefix)
        assert created == prefix - read and rest == total - prefix, (turn, created, rest)
        if turn:  # all of it is read but the last reply, the new question and the header
            assert total - read == _hf_len(server, plain[-2:], header=True), (turn, read, total)
        previous_prefix = prefix
        history.append({"role": "assistant", "content": reply or "ok"})
        plain.append({"role": "assistant", "content": reply or "ok"})
    claude.close()
    _pool_clean(server)


def test_the_lookback_reaches_20_blocks_back(server: HttpServer) -> None:
    claude = _client(server, KEYS[2])
    words = [f"block {i} {uuid.uuid4().hex[:4]}" for i in range(25)]

    def ask(mark: int) -> tuple[int, int, int]:
        blocks = [{"type": "text", "text": w} for w in words]
        blocks[mark] = {**blocks[mark], "cache_control": CC}
        r = claude.messages.create(model=server.model, max_tokens=1,
                                   messages=[{"role": "user", "content": blocks}])
        return _usage(r)

    first = ask(0)
    assert first[0] == 0 and first[1] > 0
    assert ask(21)[0] == 0  # block 0 is 22 positions back from block 21: out of the window
    assert ask(19)[0] == first[1]  # 20 positions back from block 19, the breakpoint's own first
    claude.close()


def test_mixed_ttls_split_the_writes(server: HttpServer) -> None:
    claude = _client(server, KEYS[3])
    system = [{"type": "text", "text": SYSTEM, "cache_control": {**CC, "ttl": "1h"}}]
    held_system = _hf_len(server, [{"role": "system", "content": SYSTEM}], header=False)

    def ask(question: str) -> Any:
        return claude.messages.create(
            model=server.model, max_tokens=2, system=system,
            messages=[{"role": "user", "content": [{"type": "text", "text": question,
                                                   "cache_control": CC}]}])

    first = ask("Saws?")
    prefix = _hf_len(server, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Saws?"}], header=False)
    creation = first.usage.cache_creation
    assert (creation.ephemeral_1h_input_tokens, creation.ephemeral_5m_input_tokens) == (
        held_system, prefix - held_system)
    second = ask("Drills?")  # the 1h system prefix is read; only the 5m tail is written
    assert second.usage.cache_read_input_tokens == held_system
    assert second.usage.cache_creation.ephemeral_1h_input_tokens == 0
    prefix = _hf_len(server, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "Drills?"}], header=False)
    assert second.usage.cache_creation.ephemeral_5m_input_tokens == prefix - held_system
    claude.close()


def test_a_held_prefix_survives_another_tenants_flood(server: HttpServer) -> None:
    """Tenant A holds a system prompt; tenant B's traffic cycles the whole pool. A prefix
    A did not hold is evicted (the engine's own cached_tokens, through chat completions),
    the held one is still there and read."""
    a, b = KEYS[4], KEYS[5]
    claude = _client(server, a)
    system = f"{SYSTEM} Shop {uuid.uuid4().hex[:6]}."
    unheld = f"Unrelated notes {uuid.uuid4().hex[:6]}: " + "bolts and nuts " * 60
    held = _hf_len(server, [{"role": "system", "content": system}], header=False)
    first = claude.messages.create(model=server.model, max_tokens=1, messages=[
        {"role": "user", "content": "Hello?"}],
        system=[{"type": "text", "text": system, "cache_control": CC}])
    assert first.usage.cache_creation_input_tokens == held
    chat_a = server.openai(api_key=a)
    chat_a.chat.completions.create(model=server.model, max_tokens=1,
                                   messages=[{"role": "user", "content": unheld}])
    chat_b = server.openai(api_key=b)
    for i in range(2 * POOL // 400):  # B's prompts: ~400 tokens each, twice the pool
        chat_b.chat.completions.create(model=server.model, max_tokens=1, messages=[
            {"role": "user", "content": f"{i} {uuid.uuid4().hex} " + "flood tokens " * 100}])
    again = chat_a.chat.completions.create(model=server.model, max_tokens=1,
                                           messages=[{"role": "user", "content": unheld}])
    assert again.usage.prompt_tokens_details.cached_tokens < 16, "the flood evicted nothing"
    probe = chat_a.chat.completions.create(model=server.model, max_tokens=1, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "Probe?"}])
    assert probe.usage.prompt_tokens_details.cached_tokens >= held  # held through the flood
    after = claude.messages.create(model=server.model, max_tokens=1, messages=[
        {"role": "user", "content": "Hello again?"}],
        system=[{"type": "text", "text": system, "cache_control": CC}])
    assert after.usage.cache_read_input_tokens == held
    for c in (claude, chat_a, chat_b):
        c.close()
    _pool_clean(server)


def test_holds_are_their_tenants_own(server: HttpServer) -> None:
    system = [{"type": "text", "text": f"{SYSTEM} {uuid.uuid4().hex[:6]}", "cache_control": CC}]
    usages = []
    for key in (KEYS[6], KEYS[7], KEYS[7]):
        claude = _client(server, key)
        r = claude.messages.create(model=server.model, max_tokens=1, system=system,
                                   messages=[{"role": "user", "content": "Hi?"}])
        usages.append(_usage(r))
        claude.close()
    held = usages[0][1]
    assert [u[:2] for u in usages] == [(0, held), (0, held), (held, 0)]


def test_a_write_beyond_the_tenants_quota_is_input(server: HttpServer) -> None:
    claude = _client(server, KEYS[0])
    big = "Long standing instructions about every tool in the shop. " * 35  # > QUOTA tokens
    kw = dict(model=server.model, max_tokens=1,
              system=[{"type": "text", "text": big, "cache_control": CC}],
              messages=[{"role": "user", "content": "Hi?"}])
    total = _hf_len(server, [{"role": "system", "content": big},
                             {"role": "user", "content": "Hi?"}], header=True)
    assert total > QUOTA
    for _ in range(2):  # refused each time: nothing was held, nothing is read
        r = claude.messages.create(**kw)
        assert _usage(r) == (0, 0, total)
    claude.close()
    _pool_clean(server)


# -- bounds (as the OpenAI routes: test_bounds.py) ----------------------------------------------


def _error(status: int, body: Any, expect: int, says: str) -> None:
    assert status == expect, body
    assert body["type"] == "error" and says in body["error"]["message"], body


def test_bounds_hold_on_the_messages_routes(server: HttpServer) -> None:
    def post(path: str, **fields: Any) -> tuple[int, Any]:
        body = {"model": server.model, "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}], **fields}
        return server.request("POST", path, json.dumps(body).encode(), key=KEYS[0])

    tool = {"name": "t", "input_schema": {"type": "object"}}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        _error(*post(path, tools=[{**tool, "name": f"t{i}"} for i in range(3)]), 400, "--max-tools")
        parts = [{"type": "text", "text": str(i)} for i in range(31)]
        _error(*post(path, messages=[{"role": "user", "content": parts}]), 400, "--max-parts")
        results = [{"type": "tool_result", "tool_use_id": "x", "content": [
            {"type": "text", "text": str(i)} for i in range(16)]} for _ in range(2)]
        _error(*post(path, messages=[{"role": "user", "content": results}]), 400, "--max-parts")
        deep: Any = {"type": "object"}
        for _ in range(70):
            deep = {"type": "object", "properties": {"x": deep}}
        _error(*post(path, tools=[{**tool, "input_schema": deep}]), 400, "nests deeper")
        _error(*post(path, output_config={"format": {"type": "json_schema", "schema": deep}}),
               400, "nests deeper")
        _error(*post(path, max_tokens=2**64), 400, "")


def test_reads_with_pages_of_16_tokens(tmp_path: Path, http_model_dir: Path) -> None:
    """The tree shares whole pages: a held prefix is served up to its last full page (or
    further, where an earlier prompt shares more of it), and what is read is what the
    engine served of it, never more; the rest of it is written again."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(http_model_dir))

    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    questions = ("Alpha?", "Bravo?", "Zulu?")
    system = SYSTEM
    while True:  # a prefix whose last page is short enough that the questions end it
        held = len(tok(tok.apply_chat_template([{"role": "system", "content": system}],
                                               tokenize=False), add_special_tokens=False)["input_ids"])
        if 0 < held % 16 <= 8:
            break
        system += " x"
    prompts = [ids([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    port = free_port()
    with start_test_server(tmp_path, http_model_dir, "--http", f"127.0.0.1:{port}",
                           "--api-key", KEYS[0], "--page-size", "16") as handle:
        server = HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name,
                            http_model_dir)
        claude = _client(server, KEYS[0])
        usages = [_usage(claude.messages.create(
            model=server.model, max_tokens=1,
            system=[{"type": "text", "text": system, "cache_control": CC}],
            messages=[{"role": "user", "content": q}])) for q in questions]
        claude.close()
        with server.server.client(timeout_s=60) as raw:
            assert_pool_clean(raw)
    assert usages[0][:2] == (0, held)
    for i in (1, 2):
        shared = max(next((k for k, (a, b) in enumerate(zip(prompts[i], p, strict=False))
                           if a != b), len(p)) for p in prompts[:i])
        read = min(held, shared - shared % 16)
        assert usages[i][:2] == (read, held - read), (usages, shared, held)
    assert any(u[0] < held for u in usages[1:]), "no read ended at a page before the prefix's end"
