"""Comments, docstrings and the other docs say what the code does: every module, class,
function and file they name in backticks exists (the check of test_docs_names.py, run
over every comment and docstring of the product and over docs/*.md and README.md).

A name that is not ours is written as such: another library's (`FOREIGN_HEADS`,
`FOREIGN`), a protocol or HTTP value the code compares as a string (found among the
code's strings), a route (``/v1/...``), a header (``Retry-After``), a placeholder path
(``DIR/server.key``) or a pattern (``blk.N.ffn_{gate,up}``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tests.test_docs_names import REPO, Names, _product_files, check_span, names  # noqa: F401

DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
# Heads of dotted names that belong to other libraries or formats: transformers' and
# tokenizers' objects, SGLang's frontend (`sgl.*`, what radixlm imitates), OpenAI's
# Responses events (`response.output_text.delta`), GGUF metadata keys and tensor names
# (`tokenizer.ggml.pre`, `attention.sliding_window_pattern`, `blk.N...`), HF weight names
# (`model.language_model.*`), the stdlib's `concurrent.futures`.
FOREIGN_HEADS = {"tokenizers", "sgl", "sglang", "response", "concurrent", "libgomp",
                 "socket_base", "proc", "cache_creation"}  # (Anthropic's usage object)
FOREIGN_DOTTED = re.compile(
    r"^(tokenizer\.ggml|general|attention|rope|blk|model\.(language_model|safetensors)"
    r"|output\.weight|token_embd)\b")
# Bare names of other libraries, tools and standards that comments and docs mention.
FOREIGN = {
    "TextStreamer", "GGUFReader", "convert_ids_to_tokens",  # transformers' / gguf-py's
    "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",  # FlashInfer
    "OpenAIConversationsSession", "Agent", "NativeOutput", "bind_tools",  # agent frameworks
    "ValidationError",  # msgspec's
    "rand", "kill", "tanh", "roll", "rotate_half", "chmod", "curl",  # C, math, shell
    "cache_salt",  # vLLM's request field
    "ZMQ_CURVE_SERVERKEY", "CURVE_PUBLICKEY", "CURVE_SECRETKEY",  # libzmq's options
    "SglFunction", "REGEX_INT",  # SGLang's
    "Grammar",  # xgrammar's
    "Authorization",  # an HTTP header
    "ANTHROPIC_BASE_URL", "server_tool_use",  # Anthropic's SDK's variable, API's block type
}


def _spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of each inline code span: ``double`` (reStructuredText) or
    `single`, fenced blocks left out."""
    text = re.sub(r"(?ms)^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), text)
    out = []
    for m in re.finditer(r"``(.+?)``|`([^`]+)`", text, re.S):
        span = m.group(1) if m.group(1) is not None else m.group(2)
        out.append((text.count("\n", 0, m.start()) + 1, " ".join(span.split())))
    return out


def _comments(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment and docstring of a module."""
    source = path.read_text()
    found = [(tok.start[0], tok.string) for tok in
             tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body and isinstance(node.body[0], ast.Expr):
                found.append((node.body[0].lineno, doc))
    return found


def not_ours(span: str, strings: set[str] = frozenset()) -> bool:  # type: ignore[assignment]
    """A span that names something that is not the product's (see the module doc);
    `strings`: the words of the code's string constants (logger and metric names)."""
    head = re.split(r"[.(\s]", span)[0]
    if span.startswith(("/", "_", "from ", "import ")) or head in FOREIGN | FOREIGN_HEADS:
        return True  # a route or REPL command, a name's fragment, a quoted import
    if re.search(r"[{<*]|\.\.\.|: |:$| @ ", span):  # a pattern, a placeholder, a header,
        return True  # a dict, a prompt's label, matrix arithmetic
    if span in strings or span.removesuffix("_total") in strings:
        return True  # a logger's or a metric's name: a value, found among the code's strings
    if re.fullmatch(r"[A-Z][a-z]+(-[A-Z][a-z]*)+", span):  # an HTTP header: Retry-After
        return True
    if re.search(r"(^|/)[A-Z][A-Z0-9_]*(/|\.|$)", span) and "/" in span:  # DIR/..., TENANT/NS
        return True
    if re.fullmatch(r"radixlm-X+/?|[\w.]+\.(sqlite|safetensors|so(\.\d+)?|cpp|key|bin)", span):
        return True  # a file's name pattern, a name of a file the code makes or reads
    return bool(FOREIGN_DOTTED.match(span))


def problems_in(text: str, where: str, first_line: int, names: Names) -> list[str]:  # noqa: F811
    out = []
    for line, span in _spans(text):
        if not_ours(span, names.strings):
            continue
        out += [f"{where}:{first_line + line - 1} `{span}`: {p}" for p in check_span(span, names)]
    return out


def test_every_name_in_comments_and_docstrings_exists(names: Names) -> None:  # noqa: F811
    problems = []
    for path in _product_files():
        rel = path.relative_to(REPO).as_posix()
        for line, text in _comments(path):
            problems += problems_in(text, rel, line, names)
    assert problems == [], "\n".join(problems)


def test_every_name_in_the_other_docs_exists(names: Names) -> None:  # noqa: F811
    problems = []
    for doc in DOCS:
        if doc.name == "architecture.md":  # test_docs_names.py's
            continue
        problems += problems_in(doc.read_text(), doc.relative_to(REPO).as_posix(), 1, names)
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(("text", "bad"), [
    ("# See `engine_wire.py` for the messages.", "no file 'engine_wire.py'"),  # moved away
    ("# `runtime.grammar.NoSuchMask` holds the bits.", "NoSuchMask"),
    ('"""The `SessionBusy` reply."""', "no class 'SessionBusy'"),
    ("# `PrefixCache.no_such_method()` is called", "PrefixCache has no 'no_such_method'"),
])
def test_a_stale_name_in_a_comment_is_caught(names: Names, text: str, bad: str) -> None:  # noqa: F811
    assert any(bad in p for p in problems_in(text, "x.py", 1, names))


@pytest.mark.parametrize("span", [
    "/v1/chat/completions", "Retry-After", "DIR/server.key", "TENANT/NS", "engine.sqlite",
    "tokenizer.ggml.pre", "blk.N.ffn_{gate,up}_exps.weight", "response.output_text.delta",
    "sgl.gen", "tokenizers.Tokenizer",
])
def test_names_that_are_not_ours_pass(span: str) -> None:
    assert not_ours(span)
