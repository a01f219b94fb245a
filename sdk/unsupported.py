"""The parts of SGLang's frontend radixlm refuses by design, each with a clear error.

- Hosted API backends (``sgl.OpenAI``, ``Anthropic``, ``LiteLLM``, ``VertexAI``,
  ``Crusoe``): radixlm runs programs on its own engine, whose sessions and radix cache
  are the point; a hosted API has neither.
- Vision inputs (``sgl.image``, ``sgl.video``): the engine serves text models only
  (the Llama family, Qwen2, Qwen3).

Each name is a callable that raises `UnsupportedError`; ``__radixlm_unsupported__`` says
why (for tools that list what is refused without calling it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from radixlm.sdk.errors import UnsupportedError

__all__ = ["Anthropic", "Crusoe", "LiteLLM", "OpenAI", "VertexAI", "image", "video"]

_HOSTED = ("{name}(...) is SGLang's hosted {what} backend; radixlm runs programs on its own "
           "engine only: use rl.Engine() (a local model, e.g. the embedded SmolLM2) or "
           "rl.connect(endpoint) to a `radixlm serve`, then rl.set_default_backend(...)")
_VISION = ("{name}() appends {what} to a program, but radixlm serves text-only models (the "
           "Llama family, Qwen2, Qwen3): there is no vision model to send it to. Put a "
           "description of it in the prompt as text, or run vision programs on SGLang with "
           "a vision model")


def _refusal(name: str, message: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedError(message)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = message
    refuse.__radixlm_unsupported__ = message  # type: ignore[attr-defined]
    return refuse


OpenAI = _refusal("OpenAI", _HOSTED.format(name="OpenAI", what="OpenAI API"))
Anthropic = _refusal("Anthropic", _HOSTED.format(name="Anthropic", what="Anthropic API"))
LiteLLM = _refusal("LiteLLM", _HOSTED.format(name="LiteLLM", what="LiteLLM"))
VertexAI = _refusal("VertexAI", _HOSTED.format(name="VertexAI", what="Google Vertex AI"))
Crusoe = _refusal("Crusoe", _HOSTED.format(name="Crusoe", what="Crusoe cloud"))
image = _refusal("image", _VISION.format(name="image", what="an image"))
video = _refusal("video", _VISION.format(name="video", what="a video"))
