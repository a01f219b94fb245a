"""Bounds on a request's head (request line and headers), enforced in uvicorn's protocol,
as the bytes arrive: a request whose head is too large or has too many headers gets 431
and its connection is closed before the head is parsed further, before any route runs,
and so before its API key is looked at. (httptools itself buffers a header of any size.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_json = msgspec.json.Encoder()


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a head past its bounds."""


def _refusal(message: str) -> bytes:
    body = _json.encode({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": "request_header_fields_too_large"}})
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n" + body)


def limited_protocol(max_head_bytes: int, max_headers: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, refusing heads over `max_head_bytes` or with more
    than `max_headers` headers."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # between a message's first byte and its headers' end
            self._head_bytes = 0
            self._header_count = 0
            self._refused: str | None = None

        def data_received(self, data: bytes) -> None:
            if self._refused is not None:
                return
            if not self._in_head:
                super().data_received(data)
                return
            room = max_head_bytes - self._head_bytes
            self._head_bytes += len(data)
            if len(data) <= room:
                super().data_received(data)
                return
            super().data_received(data[:room])  # the head may end within its bound
            if self._in_head:
                self._refuse(f"the request head is larger than {max_head_bytes} bytes "
                             "(--max-header-bytes)")
            elif self._refused is None:
                self.data_received(data[room:])

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > max_headers:
                self._refused = f"more than {max_headers} headers (--max-headers)"
                raise _Refused
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = self._header_count = 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True  # the next request on this connection starts its head
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if self._refused is not None:  # the parser stopped at our callback's refusal
                self._refuse(self._refused)
            else:
                super().send_400_response(msg)

        def _refuse(self, message: str) -> None:
            self._refused = message
            self.logger.info("refused a request: %s", message)
            if not self.transport.is_closing():
                self.transport.write(_refusal(message))
                self.transport.close()

    return LimitedHttpToolsProtocol
