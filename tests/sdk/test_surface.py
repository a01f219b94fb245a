"""The SDK's public surface: the synchronous classes take exactly the parameters of the
async ones they drive (as type checkers and ``help()`` see them), sampling keywords are
the protocol's `SamplingParams` fields, and a misspelt keyword is named with a hint."""

from __future__ import annotations

import inspect

import pytest
import radixlm as rl
from radixlm.runtime.protocol import SamplingParams
from radixlm.sdk.chat import AsyncChatSession
from radixlm.sdk.options import SamplingOptions, sampling_params

# The SGLang spellings the SDK accepts, and the protocol field each one means.
SGLANG_NAMES = {"max_new_tokens": "max_tokens", "return_logprob": "logprobs",
                "top_logprobs_num": "top_logprobs", "min_new_tokens": "min_tokens"}


# AsyncClient's building blocks for programs and chat sessions (not user calls).
PLUMBING = {"call", "request", "run_generate", "generate_message", "new_rid", "post", "cork",
            "close_session_unawaited"}


def public_methods(cls: type) -> dict[str, object]:
    return {name: fn for name, fn in vars(cls).items()
            if not name.startswith("_") and callable(fn)}


def parameters(fn: object) -> list[inspect.Parameter]:
    params = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    return params[1:] if params and params[0].name == "self" else params


@pytest.mark.parametrize(("sync_cls", "async_cls"), [
    (rl.Client, rl.AsyncClient), (rl.ChatSession, AsyncChatSession),
])
def test_sync_methods_take_the_async_parameters(sync_cls: type, async_cls: type) -> None:
    async_methods = public_methods(async_cls)
    shared = set(public_methods(sync_cls)) & set(async_methods)
    assert {"generate", "stream", "session", "pin"} <= shared or {"send", "stream"} <= shared
    for name in shared:
        assert parameters(getattr(sync_cls, name)) == parameters(async_methods[name]), name
    # Every call of the async client has its blocking twin.
    if sync_cls is rl.Client:
        assert set(async_methods) - PLUMBING <= set(public_methods(sync_cls))


def test_no_public_call_hides_its_keywords_behind_kwargs_any() -> None:
    for cls in (rl.Client, rl.AsyncClient, rl.ChatSession, AsyncChatSession):
        for name, fn in public_methods(cls).items():
            for p in parameters(fn) if name not in PLUMBING else ():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    assert p.annotation in ("Unpack[SamplingOptions]", "Unpack[TurnOptions]"), (
                        f"{cls.__name__}.{name}")
    assert [p.name for p in parameters(rl.connect)] == [p.name for p in
                                                         parameters(rl.AsyncClient.__init__)]


def test_sampling_options_are_the_protocol_fields_plus_sglang_names() -> None:
    generate_fields = {"tools", "tool_choice"}  # Generate fields sent with the keywords
    assert set(SamplingOptions.__annotations__) == (
        set(SamplingParams.__struct_fields__) | set(SGLANG_NAMES) | generate_fields)
    for sglang, field in SGLANG_NAMES.items():
        value = 3 if field != "logprobs" else True
        assert getattr(sampling_params({sglang: value}), field) == value


def test_a_misspelt_sampling_keyword_is_named_with_a_hint() -> None:
    with pytest.raises(TypeError, match=r"'temprature' \(did you mean 'temperature'\?\)"):
        sampling_params({"temprature": 0})


@pytest.mark.parametrize("endpoint", ["localhost:30000", "http://localhost:30000"])
def test_an_address_that_is_no_engine_endpoint_gets_a_clear_error(endpoint: str) -> None:
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT|ZeroMQ") as e:
        rl.connect(endpoint)
    if "://" not in endpoint:
        assert "did you mean 'tcp://localhost:30000'" in str(e.value)
    with pytest.raises(ValueError, match="cannot connect"):
        rl.AsyncClient(endpoint)


def test_every_public_name_has_a_docstring() -> None:
    import radixlm.testing

    missing = []
    for module in (rl, radixlm.testing):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, (int, str)):
                continue  # constants: documented by their comment
            if not (obj.__doc__ or "").strip():
                missing.append(name)
            members = vars(obj).items() if inspect.isclass(obj) else ()
            for attr, value in members:
                doc = value.fget.__doc__ if isinstance(value, property) else value.__doc__
                public = not attr.startswith("_")
                if public and (callable(value) or isinstance(value, property)) and not (
                        doc or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, missing


def test_the_package_ships_its_type_hints_and_version() -> None:
    from importlib.metadata import version
    from pathlib import Path

    assert (Path(rl.__file__).parent / "py.typed").is_file()
    assert rl.__version__ == version("radixlm")
