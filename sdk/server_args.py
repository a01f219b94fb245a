"""SGLang's server arguments, for ``rl.Runtime(...)``, ``rl.Engine(server_args=...)`` and
``rl.ServerArgs(...)``: each one that has a radixlm equivalent becomes that ``radixlm
serve`` flag; SGLang's GPU tuning knobs without one here are accepted and have no effect;
any other name is passed on as a ``serve`` flag (radixlm's own, ``kv_tokens=8192``), and
one that ``serve`` does not know fails the start with its usage message.

    rl.Runtime(model_path="default", context_length=4096, random_seed=0)
    rl.Engine(server_args=rl.ServerArgs(model_path="path/to/model", page_size=16))
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerArgs", "engine_options"]

# SGLang's name -> radixlm's `serve` option (same meaning).
_SAME_AS = {
    "tokenizer_path": "tokenizer",
    "context_length": "context_length",
    "device": "device",
    "random_seed": "seed",
    "schedule_policy": "schedule_policy",
    "max_running_requests": "max_running",
    "chunked_prefill_size": "chunked_prefill",
    "page_size": "page_size",
    "log_level": "log_level",
    "served_model_name": "served_model_name",
    "api_key": "api_key",
    "mem_fraction_static": "kv_memory_fraction",
}
# Tuning knobs of SGLang's own GPU server with no counterpart to set here.
_NO_EFFECT = frozenset({
    "cuda_graph_max_bs", "cuda_graph_bs", "disable_cuda_graph", "disable_cuda_graph_padding",
    "trust_remote_code", "port", "host", "log_level_http", "enable_torch_compile",
    "torch_compile_max_bs", "disable_radix_cache", "disable_overlap_schedule",
    "watchdog_timeout", "show_time_cost", "enable_metrics",
})
_ATTENTION = {"flashinfer": "flashinfer", "torch_native": "torch", "torch": "torch"}


class ServerArgs:
    """SGLang's ``ServerArgs``: the model and server options of an engine to start."""

    def __init__(self, model_path: str = "default", **options: Any) -> None:
        self.model_path = model_path
        self.options = options
        engine_options(options)  # a refused value fails here, before anything starts

    def __repr__(self) -> str:
        return f"ServerArgs(model_path={self.model_path!r}, {self.options!r})"


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The `rl.Engine` keyword options (``radixlm serve`` flags) for SGLang's server
    arguments; radixlm's own flag names pass through as they are."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key in _NO_EFFECT:
            continue
        if key == "tp_size":
            if value not in (None, 1):
                raise ValueError(f"tp_size={value}: rl.Engine runs one process per engine; "
                                 "tensor parallelism is not started from here")
            continue
        if key == "attention_backend":
            if value not in _ATTENTION:
                raise ValueError(f"attention_backend={value!r}: radixlm has "
                                 f"{sorted(set(_ATTENTION.values()))}")
            out["attention"] = _ATTENTION[value]
            continue
        out[_SAME_AS.get(key, key)] = value
    return out
