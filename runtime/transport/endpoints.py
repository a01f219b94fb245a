"""Endpoint syntax, read in one place.

`parse_endpoint` reads ``ipc://PATH``, ``tcp://HOST:PORT`` and libzmq's ``inproc://NAME``
into an `Endpoint`, or raises `EndpointError` saying what is wrong, with a hint for the
usual mistakes (a bare ``host:port``, an HTTP URL, an IPv6 address without brackets).
Every reader of an endpoint goes through it: the clients' connections (`Connection`,
`RawClient`), the native ZMTP link (`Endpoint.native`), the probe, the server's bind
rules (`channel.parse_client_endpoint`) and listeners, and the router's replica list.

TCP endpoints are parsed as URLs: no user part, no path, a port in 0..65535.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

__all__ = ["Endpoint", "EndpointError", "checked_endpoint", "parse_endpoint"]

Scheme = Literal["ipc", "tcp", "inproc"]


class EndpointError(ValueError):
    """An endpoint radixlm will not use, with the reason."""


@dataclass(frozen=True)
class Endpoint:
    """A parsed endpoint: `path` for ``ipc`` (``@NAME``: Linux's abstract namespace, as
    libzmq writes it) and ``inproc``; `host` (without IPv6 brackets) and `port` for
    ``tcp``."""

    scheme: Scheme
    path: str = ""
    host: str = ""
    port: int = 0

    @property
    def address(self) -> str:
        """The endpoint written out again (an IPv6 host in brackets)."""
        if self.scheme != "tcp":
            return f"{self.scheme}://{self.path}"
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{shown}:{self.port}"

    @property
    def unix_address(self) -> str:
        """An ipc endpoint's ``AF_UNIX`` address (an abstract name starts with NUL)."""
        return "\0" + self.path[1:] if self.path.startswith("@") else self.path

    @property
    def native(self) -> tuple[str, str | tuple[str, int]] | None:
        """``("unix", address)`` or ``("tcp", (host, port))`` where a plain socket reaches
        it (`zmtp.ZmtpDealer`), else None: inproc, a wildcard, libzmq's
        ``SOURCE;HOST`` form are libzmq's."""
        if self.scheme == "ipc":
            return ("unix", self.unix_address)
        if self.scheme == "tcp" and self.host != "*" and ";" not in self.host:
            return ("tcp", (self.host, self.port))
        return None


def parse_endpoint(text: str) -> Endpoint:
    """`text` as an `Endpoint`; raises `EndpointError` saying what is wrong."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme in ("ipc", "inproc"):
        if not rest:
            raise EndpointError("ipc endpoint needs a path: ipc:///path/to/socket"
                                if scheme == "ipc" else "inproc endpoint needs a name")
        return Endpoint(scheme, path=rest)  # type: ignore[arg-type]
    if sep and scheme == "tcp":
        return _parse_tcp(text)
    if scheme in ("http", "https"):
        hint = "radixlm engines speak ZeroMQ, not HTTP"
    else:
        hint = "an engine endpoint is ipc://PATH or tcp://HOST:PORT"
        host, colon, port = text.rpartition(":")
        if not sep and colon and host and port.isdigit():
            hint += f"; did you mean 'tcp://{text}'?"
    raise EndpointError(f"endpoint {text!r} must start with ipc:// or tcp:// ({hint})")


def checked_endpoint(endpoint: str) -> Endpoint:
    """`parse_endpoint` for a client about to connect: the error says so (a bare
    ``host:port`` or an HTTP URL would reach libzmq as an unexplained "Invalid
    argument")."""
    try:
        return parse_endpoint(endpoint)
    except EndpointError as e:
        raise EndpointError(f"cannot connect: {e}; pass the endpoint `radixlm serve` "
                            "printed") from None


def _parse_tcp(text: str) -> Endpoint:
    try:
        parts = urlsplit(text)
    except ValueError as e:  # unbalanced brackets
        raise EndpointError(f"bad tcp endpoint {text!r}: {e}") from None
    if "@" in parts.netloc:
        raise EndpointError(f"tcp endpoint {text!r} has a user part ('...@'); "
                            "use tcp://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise EndpointError(f"tcp endpoint must be tcp://HOST:PORT, got {text!r}")
    host, sep, port_text = parts.netloc.rpartition(":")
    if not sep or not host or not port_text:
        raise EndpointError(f"tcp endpoint must be tcp://HOST:PORT, got {text!r}")
    if not port_text.isdigit() or int(port_text) > 65535:
        raise EndpointError(f"bad port {port_text!r} in {text!r}: give 0..65535 "
                            "(0: the system picks a free one)")
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise EndpointError(f"an IPv6 address needs brackets: tcp://[{host}]:{port}")
    return Endpoint("tcp", host=host, port=port)
