"""docs/architecture.md says what the code does: every class, function, method, attribute,
module and file it names in backticks exists in the product's code.

The names are read from the product's source (every module of the package: its classes,
functions, methods, attributes, fields, parameters, constants and the strings it
compares), not imported, so the check needs no model and no optional package. A backticked
span is read as code: each dotted name in it is checked, strictly where its shape says what
it is (`Class`, `function(...)`, `Class.member`, `module.name`, `CONSTANT`, a file path), and
against every name the code defines otherwise. Third-party and builtin names are skipped;
the few other words in backticks are listed in FOREIGN and NOT_CODE with why.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]  # the repository root is the `radixlm` package
DOC = REPO / "docs" / "architecture.md"
PRODUCT = ("cache", "tokenizer", "runtime", "sdk", "testing")  # and the root's own modules
# Dotted names whose head the product imports from another library (`np.ndarray`,
# `torch.Tensor`, `time.monotonic`) are that library's and skipped. Bare names of other
# libraries' functions and options that the page mentions:
FOREIGN = {
    "log_softmax",  # torch's (the sampler's raw logprobs)
    "apply_chat_template",  # transformers' (what `ChatTemplate.render` equals)
    "ZMQ_MAXMSGSIZE",  # libzmq's socket option (pyzmq: zmq.MAXMSGSIZE)
}
# Words in backticks that are not names at all, and why each is there.
NOT_CODE = {
    "ceil",  # arithmetic notation: `ceil(n/P)` pages
}


@dataclass
class Names:
    """What the product's source defines."""

    modules: set[str] = field(default_factory=set)  # dotted: radixlm.runtime.model.batch
    classes: set[str] = field(default_factory=set)
    functions: set[str] = field(default_factory=set)  # defs at any level (methods too)
    defined: set[str] = field(default_factory=set)  # classes, defs, module/class assignments
    members: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    bases: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # + `import *`
    class_members: set[str] = field(default_factory=set)  # every class's attributes
    params: set[str] = field(default_factory=set)  # parameters (hooks like `on_evict`)
    imported: set[str] = field(default_factory=set)  # names the code imports (`Path`)
    foreign: set[str] = field(default_factory=set)  # names bound to other libraries (`np`)
    strings: set[str] = field(default_factory=set)  # words of the code's string constants
    files: set[str] = field(default_factory=set)  # every file of the repository, posix

    def member_of(self, owner: str, member: str) -> bool:
        """`member` is defined on class or module `owner`, or on a base class of it."""
        seen, todo = set(), [owner]
        while todo:
            cls = todo.pop()
            if member in self.members.get(cls, ()):
                return True
            seen.add(cls)
            todo += [b for b in self.bases.get(cls, ()) if b not in seen]
        return False

    def modules_named(self, stem: str) -> list[str]:
        return [m for m in self.modules if m.rsplit(".", 1)[-1] == stem]


def _module_name(path: Path) -> str:
    parts = ["radixlm", *path.relative_to(REPO).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _product_files() -> list[Path]:
    files = sorted(REPO.glob("*.py"))
    for folder in PRODUCT:
        files += sorted((REPO / folder).rglob("*.py"))
    return files


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _assigned(body: list[ast.stmt]) -> set[str]:
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, ast.AnnAssign):
            out.update(_targets(node.target))
    return out


def _scan(path: Path, names: Names) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    names.modules.add(module)
    scope = names.members[module]  # what `module.name` may name
    scope |= _assigned(tree.body)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            # A module's lazy names (`radixlm.cache.KVPool`): the strings it answers to.
            scope.update(c.value for c in ast.walk(node)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str)
                         and c.value.isidentifier())
        if isinstance(node, ast.ImportFrom | ast.Import):  # re-exports
            scope.update((a.asname or a.name).split(".")[0] for a in node.names)
        if isinstance(node, ast.ImportFrom) and node.module and node.names[0].name == "*":
            names.bases[module].add(node.module)  # its names are this module's too
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.imported.update(a.asname or a.name for a in node.names)
            if not node.level and not (node.module or "").startswith("radixlm"):
                names.foreign.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("radixlm"):  # `import numpy as np`: np and numpy
                    names.foreign.update({a.asname or a.name, a.name.split(".")[0]})
    names.defined |= _assigned(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.classes.add(node.name)
            names.bases[node.name].update(b.id for b in node.bases if isinstance(b, ast.Name))
            members = names.members[node.name]
            members |= _assigned(node.body)
            for item in ast.walk(node):
                if (isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name)
                        and item.value.id in ("self", "cls")):
                    members.add(item.attr)
            names.defined |= _assigned(node.body)
            names.class_members |= members
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.functions.add(node.name)
            args = node.args
            names.params.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.strings.update(re.findall(r"[A-Za-z_][\w.-]*\w|\w", node.value))


@pytest.fixture(scope="module")
def names() -> Names:
    found = Names()
    for path in _product_files():
        _scan(path, found)
    # (setuptools' build/ keeps copies of modules that have since moved: they are not ours)
    skip = {".venv", ".venv-instructor", ".git", "node_modules", "__pycache__", "build", "dist"}
    found.files = {p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
                   if not skip & set(p.relative_to(REPO).parts)
                   and not any(part.endswith(".egg-info") for part in p.relative_to(REPO).parts)}
    return found


def doc_spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span (a span may continue on the next line)."""
    return [(text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", text)]


# A dotted name, and whether a call's parenthesis follows it.
_TOKEN = re.compile(r"(?<![\w.\-/])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\s*\()?")
_EXTENSIONS = ("py", "md", "c", "json", "js", "jinja", "toml", "gguf", "key", "key_secret")


def _looks_like_path(span: str) -> bool:
    return bool(re.fullmatch(r"[\w.\-/]+", span)) and (
        "/" in span or span.rsplit(".", 1)[-1] in _EXTENSIONS)


def _path_problem(span: str, names: Names) -> str | None:
    """A file or folder path (relative to any folder of the repository), or a folder path
    to a module and one of its names (`engine/policy.round_robin`)."""
    path = span.rstrip("/")
    if path.startswith("."):  # an extension (`.gguf`)
        return None
    if any(f == path or f.endswith("/" + path) for f in names.files):
        return None
    stem, dot, member = path.rpartition(".")
    if dot and member not in _EXTENSIONS and "/" in stem:  # a module and a name in it
        modules = [f for f in names.files if f == stem + ".py" or f.endswith("/" + stem + ".py")]
        for f in modules:
            if member in names.members[_module_name(REPO / f)]:
                return None
        return f"{stem}.py defines no {member!r}" if modules else f"no module file {stem}.py"
    if "/" not in path and path in names.strings:
        return None  # a file the code reads or writes (`ready`, `radixlm_source.json`)
    return f"no file {path!r}"


def check_span(span: str, names: Names) -> list[str]:
    """What in one span names nothing in the code."""
    if span in NOT_CODE or "://" in span or span.startswith(("-", "$", "~")):
        return []  # words that are not ours; URLs, flags, environment values, homes
    if span.startswith(("radixlm ", "pip ", "python ")):
        return []  # a command line (its flags are docs/http.md's and the CLI's concern)
    if _looks_like_path(span):
        problem = _path_problem(span, names)
        return [problem] if problem else []
    code = re.sub(r"\"[^\"]*\"|'[^']*'", "", span)  # string literals are values, not names
    while re.search(r"\[[^\[\]]*\]", code):  # shapes and indices: `k[T,Hkv,D]`
        code = re.sub(r"\[[^\[\]]*\]", "", code)
    whole = _TOKEN.fullmatch(code.strip().removesuffix("()"))  # the span is one name
    problems = []
    depth = 0
    for m in _TOKEN.finditer(code):
        depth += code.count("(", 0, m.start()) - code.count(")", 0, m.start()) - depth
        token, called = m.group(1), m.group(2) is not None
        # Plain lowercase words inside a signature's parentheses or after `->` are
        # placeholders for values (`from_hf(config_dict)`); names with a shape are checked.
        placeholder = (depth > 0 or "->" in code[: m.start()]) and not (
            called or "." in token or token[0].isupper())
        if whole is None and not called and "." not in token and token.islower():
            placeholder = True  # a word of an expression (`free + evictable == capacity`)
        problem = None if placeholder else check_name(token, called, names)
        if problem:
            problems.append(problem)
    return problems


def check_name(token: str, called: bool, names: Names) -> str | None:
    parts = token.split(".")
    if parts[0] == "rl":  # the page's `import radixlm as rl`
        parts[0] = "radixlm"
        token = ".".join(parts)
    head = parts[0]
    if head in FOREIGN or head in NOT_CODE or hasattr(builtins, head):
        return None
    if len(parts) > 1 and head in names.foreign:
        return None  # another library's: `np.ndarray`, `torch.Tensor`, `time.monotonic`
    if head == "radixlm":  # a module path, maybe with a member
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in names.modules:
                rest = parts[cut:]
                if not rest or names.member_of(module, rest[0]):
                    return None
                if module == "radixlm" and names.member_of("radixlm.sdk", rest[0]):
                    return None  # the package hands its SDK's names out on first use
                return f"{module} defines no {rest[0]!r}"
        return f"no module {token!r}"
    if len(parts) > 1:
        owner, member = parts[-2], parts[-1]
        if owner[0].isupper():  # Class.member
            if owner not in names.classes and owner not in names.defined:
                return f"no class {owner!r}"
            return None if names.member_of(owner, member) else f"{owner} has no {member!r}"
        modules = names.modules_named(owner)
        if any(names.member_of(m, member) for m in modules):
            return None  # module.member, by the module's name
        if member in names.class_members:
            return None  # value.attribute: some class has it (`config.retained_cap`)
        return f"nothing defines {member!r} (of {owner!r})"
    if len(token) <= 2 or token.isdigit():
        return None  # math variables (T, B, P, n, ...) and numbers
    if token[0].isupper() and not token.isupper():  # CamelCase: a class or an alias
        known = names.defined | names.classes | names.imported
        return None if token in known else f"no class {token!r}"
    if token.isupper():  # a constant, or an environment variable the code reads
        return None if token in names.defined or token in names.strings else (
            f"no constant {token!r}")
    if called:
        known = names.functions | names.classes | names.params | names.class_members
        return None if token in known else f"no function {token!r}"
    known = names.defined | names.class_members | names.params | names.functions | names.strings
    known |= {m.rsplit(".", 1)[-1] for m in names.modules}
    return None if token in known else f"nothing named {token!r}"


def test_every_name_in_the_architecture_page_exists(names: Names) -> None:
    problems = [f"docs/architecture.md:{line} `{span}`: {p}"
                for line, span in doc_spans(DOC.read_text()) for p in check_span(span, names)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(("span", "bad"), [
    ("SessionBusy", "no class 'SessionBusy'"),  # the kinds of stale text this test is for
    ("RetentionCapExceeded", "no class"),
    ("PrefixCache.no_such_method()", "PrefixCache has no 'no_such_method'"),
    ("radixlm.sdk.no_such_module", "no_such_module"),
    ("engine/policy.no_such", "policy.py defines no 'no_such'"),
    ("RadixCache.no_such", "RadixCache has no 'no_such'"),
    ("no_such_attribute", "nothing named"),
    ("radixlm.cache.pages.no_such", "defines no 'no_such'"),
    ("runtime/engine/no_such.py", "no file"),
    ("no_such_function(x)", "no function"),
    ("NO_SUCH_CONSTANT", "no constant"),
    ("rl.NoSuchError", "radixlm defines no 'NoSuchError'"),
])
def test_a_stale_name_is_caught(names: Names, span: str, bad: str) -> None:
    assert any(bad in p for p in check_span(span, names)), check_span(span, names)


@pytest.mark.parametrize("span", [
    "PrefixCache(capacity_tokens, page_size=1)", "radixlm.cache.pages.div_ceil",
    "ForwardBatch.build(requests, device=\"cpu\")", "runtime/model/batch.py", "--auth-dir",
    "torch.Tensor", "list[int]", "ipc://", "free + evictable + protected == capacity",
    "engine/policy.round_robin", "k[T,Hkv,D]", "HostKVPool.k_pages",  # inherited
    "rl.BusyError",  # through two `import *`
])
def test_real_names_pass(names: Names, span: str) -> None:
    assert check_span(span, names) == []
