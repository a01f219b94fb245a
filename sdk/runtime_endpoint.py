"""``rl.RuntimeEndpoint(url)``: SGLang's backend for a running server, on a radixlm one.

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:8000"))   # its HTTP API
    sgl.set_default_backend(sgl.RuntimeEndpoint("ipc:///run/user/1000/radixlm.sock"))

A ZeroMQ endpoint (``ipc://``, ``tcp://``) is connected to directly. An ``http(s)://``
URL is a ``radixlm serve --http`` server: its ``/get_model_info`` (SGLang's route) names
the engine's protocol endpoint, which is then connected to -- programs always talk to the
engine over its protocol, where sessions live. That endpoint must be reachable from here
(an ``ipc://`` one only on the server's machine); `api_key` is the HTTP API's key.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from radixlm.sdk.errors import EngineDeadError
from radixlm.sdk.sync import Client

__all__ = ["RuntimeEndpoint", "protocol_endpoint"]

_HTTP_TIMEOUT_S = 10.0
_WHAT_TO_PASS = ("pass the engine's protocol endpoint (ipc://... or tcp://..., as `radixlm "
                 "serve` prints it) or the http://HOST:PORT of a `radixlm serve --http` server")


def protocol_endpoint(base_url: str, api_key: str | None = None) -> str:
    """The engine endpoint to connect to for `base_url` (see the module docstring)."""
    if base_url.startswith(("ipc://", "tcp://")):
        return base_url
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"RuntimeEndpoint({base_url!r}): {_WHAT_TO_PASS}")
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    request = urllib.request.Request(url + "/get_model_info")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as reply:
            info = json.loads(reply.read())
    except urllib.error.HTTPError as e:
        hint = " (pass api_key=...)" if e.code == 401 else ""
        raise EngineDeadError(f"{url}/get_model_info answered HTTP {e.code}{hint}: is it a "
                              f"radixlm server? {_WHAT_TO_PASS}") from None
    except (OSError, ValueError) as e:
        raise EngineDeadError(f"cannot reach {url}/get_model_info ({e}); {_WHAT_TO_PASS}") from None
    endpoint = info.get("radixlm_endpoint") if isinstance(info, dict) else None
    if not isinstance(endpoint, str):
        raise EngineDeadError(f"{url} does not name a radixlm protocol endpoint (not a "
                              f"radixlm server, or an older one): {_WHAT_TO_PASS}")
    return endpoint


class RuntimeEndpoint(Client):
    """A `Client` of the radixlm engine at `base_url` (an engine endpoint, or the URL of
    its HTTP API), as SGLang's ``RuntimeEndpoint``: a backend for programs, with its
    ``get_model_name()``, ``get_server_info()``, ``flush_cache()`` and ``cache_prefix()``.
    `verify` and `chat_template_name` are SGLang's (the engine renders its model's own
    chat template; TLS certificates are checked as urllib does); other keywords are
    `rl.connect`'s (``server_key``, ``client_key``, ``connect_timeout``...)."""

    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template_name: str | None = None, **connect_options: Any) -> None:
        super().__init__(protocol_endpoint(base_url, api_key), **connect_options)
        self.base_url = base_url
