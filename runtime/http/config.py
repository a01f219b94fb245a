"""The HTTP frontend's configuration: one frozen object built from its flags, plus the
bind-address rule (a non-loopback address needs an API key unless told otherwise)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

DEFAULT_RESPONSE_TTL_S = 3600.0
# The frontend's heartbeat unanswered this long: the engine's requests fail with 503.
DEFAULT_LINK_TIMEOUT_S = 15.0
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = None  # what is left of the context, as vLLM
API_KEY_ENV = "RADIXLM_API_KEY"  # how `radixlm serve` hands the keys (one a line) to the HTTP process
DEFAULT_HEALTH_TIMEOUT_S = 5.0
# Bounds of one request, checked before anything is rendered or sent to the engine.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # the request line and every header, together
DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_MESSAGES = 2048  # chat messages, Responses input items, conversation items
DEFAULT_MAX_TOOLS = 128  # OpenAI's own limit
DEFAULT_MAX_PARTS = 4096  # content parts and tool calls, over all messages


class HttpConfigError(ValueError):
    """A flag value the HTTP frontend cannot start with (the message says which)."""


@dataclass(frozen=True)
class HttpConfig:
    engine_endpoint: str  # the engine's protocol endpoint (ipc:// or tcp://)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # each key a tenant; none: no key asked, one tenant
    insecure: bool = False  # allow a non-loopback bind without an API key
    metrics_require_key: bool = False  # /metrics asks for a key (always beyond loopback)
    response_ttl_s: float = DEFAULT_RESPONSE_TTL_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    served_model_name: str | None = None  # None: the engine's model name
    connect_timeout_s: float = 60.0
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S  # /health: 503 if the engine is slower
    gateway_token_file: str | None = None  # the frontend's gateway credential (tenants)
    server_key: str | None = None  # an --auth-dir server: its server.key ...
    client_key: str | None = None  # ... and the runtime directory's gateway.key_secret
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # 431 beyond, before any route runs
    max_headers: int = DEFAULT_MAX_HEADERS
    max_messages: int = DEFAULT_MAX_MESSAGES  # 400 beyond, before rendering
    max_tools: int = DEFAULT_MAX_TOOLS
    max_parts: int = DEFAULT_MAX_PARTS
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests may finish for this long
    link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S  # the frontend silent this long: 503
    state_dir: str | None = None  # the server's state directory: stored objects outlive it

    @property
    def metrics_public(self) -> bool:
        """/metrics without a key: on loopback, unless asked otherwise (as vLLM, open)."""
        return not self.api_keys or (not self.metrics_require_key and is_loopback(self.host))


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); a bare port means loopback."""
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise HttpConfigError(f"--http wants HOST:PORT, got {text!r}")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise HttpConfigError(f"--http port must be an integer in [0, 65535], got {port_text!r}")
    if host == "*":
        raise HttpConfigError("--http '*' is ambiguous: write 0.0.0.0 to listen everywhere")
    return ("127.0.0.1" if host == "localhost" else host), int(port_text)


def is_loopback(host: str) -> bool:
    """Whether `host` only ever resolves to loopback addresses."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind(host: str, api_keys: tuple[str, ...], insecure: bool) -> None:
    """Refuse to serve an unauthenticated API beyond this machine unless asked to."""
    if not api_keys and not insecure and not is_loopback(host):
        raise HttpConfigError(
            f"refusing to serve HTTP on {host} (not loopback) without an API key: give "
            "--api-key/--api-key-file, or --insecure to serve it unauthenticated on purpose")


def read_api_keys(keys: list[str] | None, key_file: str | None, env: str | None = None) -> tuple[str, ...]:
    """The API keys: every --api-key, every line of --api-key-file (blank lines and
    ``#`` comments skipped), and the lines of `env` (the environment's keys)."""
    found = [k.strip() for k in keys or []]
    texts = [env] if env else []
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                texts.append(f.read())
        except OSError as e:
            raise HttpConfigError(f"cannot read --api-key-file: {e}") from None
    for text in texts:
        found += [line.strip() for line in text.splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    if key_file is not None and not found:
        raise HttpConfigError(f"--api-key-file {key_file} holds no key (it is empty)")
    if any(not k for k in found):
        raise HttpConfigError("an API key is empty")
    if any(any(c.isspace() for c in k) for k in found):
        raise HttpConfigError("an API key holds white space")
    return tuple(dict.fromkeys(found))
