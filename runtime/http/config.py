"""The HTTP frontend's settings, each declared once (`radixlm.runtime.settings`): one
frozen `HttpConfig`, whose flags `radixlm serve` and ``python -m radixlm.runtime.http``
generate from it; `HttpSpec`, what `radixlm serve` starts its HTTP process with; and the
bind-address rule (a non-loopback address needs an API key unless told otherwise)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Annotated, Any, ClassVar

import msgspec
from radixlm.runtime.config import DRAIN_TIMEOUT_S
from radixlm.runtime.settings import Declaration, LogLevel, Settings, setting

HTTP = "HTTP (OpenAI-compatible API)"  # its --help section
# The frontend's heartbeat unanswered this long: the engine's requests fail with 503.
DEFAULT_LINK_TIMEOUT_S = 15.0
API_KEY_ENV = "RADIXLM_API_KEY"  # the keys (one a line), read where the flags are parsed


class HttpConfigError(ValueError):
    """A flag value the HTTP frontend cannot start with (the message says which)."""


def _http(help: str, *flags: str, **options: Any) -> Declaration:  # noqa: A002
    """A setting the HTTP process reads, in the HTTP section of --help."""
    return setting(help, *flags, read_by="http", group=HTTP, **options)


class HttpConfig(Settings, frozen=True):
    """Everything the HTTP process is told (`engine_endpoint` first: the one without a
    default); every value is checked as it is built."""

    error: ClassVar[type[ValueError]] = HttpConfigError

    engine_endpoint: str  # the engine's protocol endpoint (ipc:// or tcp://)
    host: Annotated[str, _http(
        "address of the HTTP API; a non-loopback one needs --api-key", "--host")] = "127.0.0.1"
    port: Annotated[int, _http(
        "port of the HTTP API; 0 = a free one", "--port", ge=0, le=65535)] = 8000  # vLLM's
    api_keys: tuple[str, ...] = ()  # each key a tenant; none: no key asked, one tenant
    metrics_require_key: Annotated[bool, _http(
        "/metrics asks for an API key on loopback too (beyond loopback it always does when "
        "keys are set)", "--metrics-require-key")] = False
    insecure: Annotated[bool, _http(
        "allow a non-loopback --http address without an API key", "--insecure")] = False
    response_ttl_s: Annotated[float, _http(
        "idle time after which a stored response or chat session expires (its id then "
        "gets 404)", "--response-ttl", gt=0, metavar="SECONDS")] = 3600.0
    link_timeout_s: Annotated[float, _http(
        "fail requests with 503 once the server's frontend has not answered the HTTP API's "
        "heartbeat for this long", "--link-timeout", gt=0,
        metavar="SECONDS")] = DEFAULT_LINK_TIMEOUT_S
    # Bounds of one request, checked before anything is rendered or sent to the engine.
    max_body_bytes: Annotated[int, _http(
        "largest request body accepted (413 beyond)", "--max-body-bytes", gt=0)] = 4 * 2**20
    max_header_bytes: Annotated[int, _http(
        "largest request head (request line and headers) accepted; 431 beyond, before the "
        "API key is looked at", "--max-header-bytes", gt=0)] = 64 * 1024
    max_headers: Annotated[int, _http(
        "most headers in one request (431 beyond)", "--max-headers", gt=0)] = 100
    max_messages: Annotated[int, _http(
        "most messages (or input items) in one request", "--max-messages", gt=0)] = 2048
    max_tools: Annotated[int, _http(
        "most tool definitions in one request", "--max-tools", gt=0)] = 128  # OpenAI's own
    max_parts: Annotated[int, _http(
        "most content parts and tool calls in one request, all messages together",
        "--max-parts", gt=0)] = 4096
    default_max_tokens: Annotated[int | None, _http(
        "output limit of requests that name none", "--default-max-tokens", gt=0,
        default_text="what is left of the context after the prompt")] = None  # as vLLM
    served_model_name: Annotated[str | None, _http(
        "the model id of /v1/models and of requests", "--served-model-name",
        default_text="the engine's")] = None
    drain_timeout_s: Annotated[float, _http(
        "on SIGTERM, how long in-flight requests may finish (a second signal stops at once)",
        "--drain-timeout", ge=0, metavar="SECONDS")] = DRAIN_TIMEOUT_S
    # Where the engine is and how to reach it for several tenants (radixlm serve gives them).
    server_key: Annotated[str | None, setting(
        "with an --auth-dir server: its public certificate (server.key)", "--server-key",
        metavar="PATH", read_by="http")] = None
    client_key: Annotated[str | None, setting(
        "with an --auth-dir server: the gateway's secret certificate (its runtime "
        "directory's gateway.key_secret)", "--client-key", metavar="PATH", read_by="http")] = None
    gateway_token_file: Annotated[str | None, setting(
        "the server's gateway credential (its runtime directory's gateway.token): each API "
        "key becomes its own tenant", "--gateway-token-file", metavar="PATH", read_by="http")] = None
    connect_timeout_s: Annotated[float, setting(
        "how long the first connection to the engine may take", gt=0, read_by="http")] = 60.0
    health_timeout_s: Annotated[float, setting(
        "/health answers 503 when the engine is slower than this", gt=0,
        read_by="http")] = 5.0

    @property
    def metrics_public(self) -> bool:
        """/metrics without a key: on loopback, unless asked otherwise (as vLLM, open)."""
        return not self.api_keys or (not self.metrics_require_key and is_loopback(self.host))


class HttpSpec(msgspec.Struct, frozen=True):
    """What `radixlm serve` starts its HTTP process with, on the child's stdin (the API
    keys in it never show in an argv or an environment)."""

    config: HttpConfig
    parent_pid: int | None = None  # the process whose exit stops this one
    log_level: LogLevel = "warning"
    fd: int | None = None  # the listening socket bound by the parent, inherited


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
