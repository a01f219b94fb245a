"""SGLang's own frontend test programs, and a census of its frontend surface, on radixlm.

    python benchmarks/sglang_conformance.py                  # census + tests, embedded model
    python benchmarks/sglang_conformance.py --census-only    # no model: the census alone
    python benchmarks/sglang_conformance.py -k select -k stream   # some tests only

Opt-in (not part of the test suite): it needs PyPI once. It downloads SGLang's wheel
(``pip download --no-deps sglang==VERSION`` into ``--cache-dir``), unpacks the few source
files it reads, and reads them at run time -- nothing of SGLang is installed, imported as
SGLang, or kept in this repository.

Tests: ``sglang/test/test_programs.py`` is imported with ``sglang`` aliased to ``radixlm``
(``import sglang as sgl`` then is ``import radixlm as sgl``), and its helper imports mapped
to radixlm's equivalents: ``sglang.lang.ir``'s regexes to `radixlm.sdk.dtypes`, and the
test-infrastructure helpers ``sglang.srt.utils.is_hip`` (False) and
``...hf_transformers_utils.get_tokenizer`` (the model's HF tokenizer, loaded with
transformers). The default backend is ``sgl.Runtime(model_path=MODEL)``, as SGLang's own
harness does. Every ``test_*`` function runs once; a parameter ``check_answer`` gets
True, and when such a test fails on an assertion it reruns with False (the API part
alone). Outcomes:

- ``pass``;
- ``answer``: an ``assert`` of the test itself failed on what the model wrote (the
  assertion line is printed; for ``check_answer`` tests, the rerun without the answer
  check passed);
- ``API``: anything else -- an exception from radixlm, or an assertion about the API;
- ``vision``/``hosted``: the test uses ``sgl.image``/``sgl.video`` or
  ``num_api_spec_tokens`` (API speculative execution, OpenAI-style backends only) and
  failed; radixlm refuses those with a clear error by design.

Census: the names SGLang's frontend exports (``sglang/__init__.py``'s ``__all__`` and the
public functions of ``sglang/lang/api.py``), the methods of ``ProgramState`` /
``ProgramStateGroup`` (``lang/interpreter.py``) and of ``SglFunction`` (``lang/ir.py``,
what ``@function`` makes), and the keyword parameters of those functions and of
``SglFunction.run`` / ``run_batch``, all parsed from SGLang's source. A name is present
when radixlm has it; a keyword when a call passing it with SGLang's default value is
accepted (program runs go to a `radixlm.testing.StubServer`). Names radixlm refuses by
design (hosted backends, vision) are counted apart.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import subprocess
import sys
import time
import traceback
import types
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_VERSION = "0.5.23"
DEFAULT_CACHE = Path.home() / ".cache" / "radixlm" / "sglang-reference"
# The files read from the wheel (nothing else is unpacked).
NEEDED = ("sglang/__init__.py", "sglang/lang/api.py", "sglang/lang/interpreter.py",
          "sglang/lang/ir.py", "sglang/test/test_programs.py")


# -- the reference wheel ------------------------------------------------------------------


def reference_sources(version: str, cache: Path) -> Path:
    """The directory holding SGLang `version`'s NEEDED files (downloaded once)."""
    root = cache / f"sglang-{version}"
    if all((root / name).is_file() for name in NEEDED):
        return root
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        f"sglang=={version}", "-d", str(cache)], check=True)
        wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for name in NEEDED:
            wheel.extract(name, root)
    return root


def _parse(root: Path, name: str) -> ast.Module:
    return ast.parse((root / name).read_text(encoding="utf-8"))


# -- the census -----------------------------------------------------------------------------


@dataclass
class Item:
    kind: str  # "name", "method", "keyword"
    what: str  # e.g. "gen", "ProgramState.var_scope", "gen(min_tokens=)"
    status: str = "missing"  # "present", "refused", "missing"
    note: str = ""


def _all_names(module: ast.Module) -> list[str]:
    for node in module.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return []


def _functions(module: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in module.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _class(module: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> list[str]:
    skip = {"__init__", "__del__"}
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef)
            and n.name not in skip and not (n.name.startswith("_") and not n.name.endswith("__"))]


@dataclass
class Param:
    name: str
    default: ast.expr | None
    annotation: str  # as written in SGLang's source ("" if none)


def _keywords(fn: ast.FunctionDef) -> list[Param]:
    """Every named parameter (not *args/**kwargs, not `s` or `self`)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    pairs = [*zip(positional, defaults, strict=True), *zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return [Param(p.arg, d, ast.unparse(p.annotation) if p.annotation else "")
            for p, d in pairs if p.arg not in ("self", "s")]


def _sample(rl: Any, param: Param) -> Any:
    """A value that is not "not given", of the parameter's annotated type: a keyword is
    present only if radixlm takes such a value too (any function takes ``x=None`` when
    it drops Nones)."""
    t = param.annotation
    if param.name == "choices":
        return ["a", "b"]
    if "ChoicesSamplingMethod" in t:
        return getattr(rl, "greedy_token_selection", None)
    if param.name in ("regex", "stop_regex"):
        return "[0-9]+"
    if param.name == "json_schema":
        return '{"type": "integer"}'
    for key, value in (("List[int]", [2]), ("List[str]", ["x"]), ("type", int), ("bool", True),
                       ("float", 0.5), ("int", 1), ("str", "x")):
        if key in t:
            return value
    return None


def _default_value(rl: Any, expr: ast.expr | None) -> Any:
    """SGLang's default for a parameter, as a value radixlm can take (None if none)."""
    if expr is None:
        return None
    try:
        return ast.literal_eval(expr)
    except ValueError:
        if isinstance(expr, ast.Name) and hasattr(rl, expr.id):
            return getattr(rl, expr.id)  # e.g. token_length_normalized
        return None


def _refused(obj: Any) -> str | None:
    """Why radixlm refuses this name by design (hosted backend, vision), if it does."""
    return getattr(obj, "__radixlm_unsupported__", None)


def census(root: Path) -> list[Item]:
    import radixlm as rl

    init, api = _parse(root, NEEDED[0]), _parse(root, NEEDED[1])
    interp, ir = _parse(root, NEEDED[2]), _parse(root, NEEDED[3])
    items: list[Item] = []
    api_fns = _functions(api)
    names = dict.fromkeys([*_all_names(init), *api_fns])
    for name in names:
        item = Item("name", name)
        if hasattr(rl, name):
            why = _refused(getattr(rl, name))
            item.status, item.note = ("refused", why) if why else ("present", "")
        items.append(item)
    for cls, ours in (("ProgramState", rl.ProgramState), ("ProgramStateGroup", rl.ProgramStateGroup)):
        for m in _methods(_class(interp, cls)):
            items.append(Item("method", f"{cls}.{m}", "present" if hasattr(ours, m) else "missing"))
    for m in _methods(_class(ir, "SglFunction")):
        items.append(Item("method", f"SglFunction.{m}", "present" if hasattr(rl.Program, m) else "missing"))
    for name, fn in api_fns.items():
        for param in _keywords(fn):
            items.append(_keyword_item(rl, name, param))
    items += _run_keywords(rl, _class(ir, "SglFunction"))
    return items


def _call_for(rl: Any, name: str) -> Callable[..., Any] | None:
    """A call of radixlm's `name` with the arguments it needs besides the one under test."""
    fn = getattr(rl, name, None)
    if fn is None or _refused(fn):
        return None
    required: dict[str, dict[str, Any]] = {
        "select": {"name": "x", "choices": ["a", "b"]},
        # A model type its parsers know (SGLang checks it when the program runs).
        "separate_reasoning": {"expr": rl.gen("x"), "model_type": "qwen3"}
        if hasattr(rl, "gen") else {},
        "function": {"func": lambda s: None},
    }
    base = required.get(name, {})
    return lambda **kw: fn(**{**base, **kw})


def _keyword_item(rl: Any, fn_name: str, param: Param) -> Item:
    key = param.name
    item = Item("keyword", f"{fn_name}({key}=)")
    fn = getattr(rl, fn_name, None)
    if fn is not None and _refused(fn):
        item.status, item.note = "refused", _refused(fn) or ""
        return item
    call = _call_for(rl, fn_name)
    if call is None:
        item.note = f"no {fn_name}"
        return item
    if fn_name in ("Runtime", "Engine"):  # starting an engine is not a census probe
        params = inspect.signature(fn).parameters
        ok = key in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        item.status = "present" if ok else "missing"
        return item
    values = [_default_value(rl, param.default), _sample(rl, param)]
    if fn_name == "separate_reasoning" and key == "model_type":
        values = ["qwen3", "deepseek-r1"]
    if fn_name == "select" and key == "temperature":
        values = [_default_value(rl, param.default)]  # SGLang's select scores at 0 only
    if fn_name == "select" and key == "choices":
        values = [["a", "b"]]
    if fn_name == "function" and key == "func":
        values = [lambda s: None]
    if key == "backend":
        values = [rl.get_default_backend() if hasattr(rl, "get_default_backend") else None]
    try:
        for value in values:
            call(**{key: value})
        item.status = "present"
    except Exception as e:  # noqa: BLE001 - reported
        item.note = f"{type(e).__name__}: {e}"[:120]
    return item


def _run_keywords(rl: Any, cls: ast.ClassDef) -> list[Item]:
    """Each keyword of SglFunction.run / run_batch, passed with SGLang's default to a
    one-line program run on a StubServer."""
    from radixlm.testing import StubServer

    items: list[Item] = []
    fns = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}

    @rl.function
    def probe(s):
        s += "Hi" + rl.gen("x", max_tokens=1)

    with StubServer() as stub, rl.connect(stub.endpoint) as client:
        for method in ("run", "run_batch"):
            for param in _keywords(fns[method]):
                item = Item("keyword", f"SglFunction.{method}({param.name}=)")
                default = _default_value(rl, param.default)
                values = [default] if default is not None else [None, _sample(rl, param)]
                if param.name in ("backend", "batch_kwargs"):
                    values = [None]
                try:
                    for value in values:
                        _probe_run(probe, client, method, param.name, value)
                    item.status = "present"
                except Exception as e:  # noqa: BLE001 - reported
                    item.note = f"{type(e).__name__}: {e}"[:120]
                items.append(item)
    return items


def _probe_run(probe: Any, client: Any, method: str, key: str, value: Any) -> None:
    kwargs = {} if key in ("backend", "batch_kwargs") else {key: value}
    if method == "run":
        state = probe.run(backend=client, **kwargs)
        state.sync()
        state.text()
    else:
        for state in probe.run_batch([{}, {}], backend=client, **kwargs):
            state.text()


def print_census(items: list[Item]) -> None:
    present = sum(i.status == "present" for i in items)
    refused = [i for i in items if i.status == "refused"]
    missing = [i for i in items if i.status == "missing"]
    print(f"\n## Census of SGLang's frontend surface: {present} of {len(items)} present, "
          f"{len(refused)} refused by design, {len(missing)} missing\n")
    for kind in ("name", "method", "keyword"):
        of_kind = [i for i in items if i.kind == kind]
        print(f"- {kind}s: {sum(i.status == 'present' for i in of_kind)} of {len(of_kind)} present")
    if refused:
        print("\nRefused by design (a clear error when used):")
        for i in refused:
            print(f"  {i.what}: {i.note}")
    if missing:
        print("\nMissing:")
        for i in missing:
            print(f"  {i.what}" + (f"  ({i.note})" if i.note else ""))


# -- SGLang's test programs -------------------------------------------------------------------


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _hf_tokenizer(model_path: str) -> Any:
    """SGLang's test helper `get_tokenizer(model_path)`: the model's own HF tokenizer."""
    from radixlm.runtime.model.resolve import resolve_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model(model_path, progress=False)))


@contextlib.contextmanager
def sglang_aliased() -> Iterator[None]:
    """``sglang`` (and the helper modules test_programs.py imports) mapped to radixlm."""
    import radixlm

    try:
        from radixlm.sdk import dtypes
    except ImportError:  # an older radixlm: the test that needs them fails on the import
        dtypes = _module("sglang.lang.ir")
    aliases = {
        "sglang": radixlm,
        "sglang.lang": _module("sglang.lang", ir=dtypes),
        "sglang.lang.ir": dtypes,
        "sglang.srt": _module("sglang.srt"),
        "sglang.srt.utils": _module("sglang.srt.utils", is_hip=lambda: False),
        "sglang.srt.utils.hf_transformers_utils": _module(
            "sglang.srt.utils.hf_transformers_utils", get_tokenizer=_hf_tokenizer),
    }
    saved = {k: sys.modules.get(k) for k in aliases}
    sys.modules.update(aliases)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@dataclass
class Outcome:
    test: str
    result: str  # pass, answer, API, vision, hosted
    seconds: float
    detail: str = ""


def _failure(test_file: str, exc: BaseException) -> tuple[bool, str]:
    """(whether it is the test's own assert, a one-line description)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    own_assert = (isinstance(exc, AssertionError) and last is not None
                  and Path(last.filename).resolve() == Path(test_file).resolve())
    where = f"{Path(last.filename).name}:{last.lineno}" if last else "?"
    line = (last.line or "").strip() if last else ""
    message = str(exc).splitlines()[0][:160] if str(exc) else ""
    return own_assert, f"{type(exc).__name__} at {where}: {line}" + (f" -- {message}" if message else "")


def _call(fn: Callable[..., Any], **kwargs: Any) -> BaseException | None:
    try:
        fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - classified by the caller
        return e
    return None


def run_tests(root: Path, model: str, selected: list[str]) -> list[Outcome]:
    path = root / "sglang/test/test_programs.py"
    source = path.read_text(encoding="utf-8")
    with sglang_aliased():
        import radixlm as sgl

        spec = importlib.util.spec_from_file_location("sglang_test_programs", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        tests = [(n, f) for n, f in vars(module).items()
                 if n.startswith("test_") and inspect.isfunction(f)]
        if selected:
            tests = [(n, f) for n, f in tests if any(k in n for k in selected)]
        started = time.perf_counter()
        runtime = sgl.Runtime(model_path=model)
        print(f"engine for {model!r} started in {time.perf_counter() - started:.1f} s", flush=True)
        sgl.set_default_backend(runtime)
        outcomes = []
        try:
            for name, fn in tests:
                outcomes.append(_run_one(name, fn, source, str(path)))
                o = outcomes[-1]
                print(f"  {o.test}: {o.result} ({o.seconds:.1f} s) {o.detail}", flush=True)
        finally:
            sgl.set_default_backend(None)
            runtime.shutdown()
    return outcomes


def _run_one(name: str, fn: Callable[..., Any], source: str, test_file: str) -> Outcome:
    body = inspect.getsource(fn)
    check = "check_answer" in inspect.signature(fn).parameters
    start = time.perf_counter()
    exc = _call(fn, **({"check_answer": True} if check else {}))
    if exc is None:
        return Outcome(name, "pass", time.perf_counter() - start)
    own_assert, detail = _failure(test_file, exc)
    if own_assert and check:  # the API part alone
        again = _call(fn, check_answer=False)
        if again is not None:
            own_assert, detail = False, _failure(test_file, again)[1]
    seconds = time.perf_counter() - start
    if "sgl.image" in body or "sgl.video" in body:
        return Outcome(name, "vision", seconds, detail)
    if "num_api_spec_tokens" in body:
        return Outcome(name, "hosted", seconds, detail)
    return Outcome(name, "answer" if own_assert else "API", seconds, detail)


def print_tests(outcomes: list[Outcome]) -> None:
    counts = {k: sum(o.result == k for o in outcomes)
              for k in ("pass", "answer", "API", "vision", "hosted")}
    print(f"\n## SGLang's test_programs.py on radixlm: {len(outcomes)} tests\n")
    print("| test | result | seconds | detail |")
    print("|---|---|---|---|")
    for o in outcomes:
        detail = o.detail.replace("|", "\\|")
        print(f"| {o.test} | {o.result} | {o.seconds:.1f} | {detail} |")
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.items())
          + f"; ran without an API failure: {len(outcomes) - counts['API']} of {len(outcomes)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=DEFAULT_VERSION, help="SGLang version (%(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                        help="where the wheel is kept (%(default)s)")
    parser.add_argument("--model", default="default", help="model for the tests (%(default)s)")
    parser.add_argument("--census-only", action="store_true", help="skip the test programs")
    parser.add_argument("--tests-only", action="store_true", help="skip the census")
    parser.add_argument("-k", action="append", default=[], metavar="SUBSTRING",
                        help="run only tests whose name contains SUBSTRING (repeatable)")
    args = parser.parse_args(argv)
    root = reference_sources(args.version, args.cache_dir)
    print(f"SGLang {args.version} sources: {root}")
    if not args.tests_only:
        print_census(census(root))
    if not args.census_only:
        print_tests(run_tests(root, args.model, args.k))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
