"""Print the worked exchange of docs/protocol.md, captured from a live server.

    python docs/worked_exchange.py                      # starts the default model on CPU
    python docs/worked_exchange.py --endpoint ipc://... # or talks to a running server

The exchange itself is a client written with pyzmq and msgpack only (no radixlm import):
one DEALER socket, one msgpack map per frame. Each printed line is one frame decoded to
JSON, ``C:`` from the client and ``S:`` from the server, in the order they were seen.
`tests/protocol/test_protocol_docs.py` runs `exchange` against its test server and compares the
result with the page.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgpack
import zmq

NOT_MSGPACK = b"\xc1\xc1\xc1"  # 0xc1 is never used by msgpack
TIMEOUT_MS = 120_000


class _Wire:
    """One DEALER connection that records every frame both ways."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        self.sock.connect(endpoint)
        self.lines: list[tuple[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.lines.append(("C", message))
        self.sock.send(msgpack.packb(message))

    def send_bytes(self, data: bytes) -> None:
        self.lines.append(("C", data))
        self.sock.send(data)

    def receive(self) -> dict[str, Any]:
        message = msgpack.unpackb(self.sock.recv())
        self.lines.append(("S", message))
        return message

    def until_final(self) -> dict[str, Any]:
        """Receive until a reply that ends a request (anything but a chunk)."""
        while (message := self.receive())["type"] == "chunk":
            pass
        return message

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _turn(rid: str, session: str, content: str, max_tokens: int,
          stream: bool = False) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "generate", "rid": rid, "session": session}
    if stream:
        message["stream"] = True
    message["input"] = {"messages": [{"role": "user", "content": content}]}
    message["sampling"] = {"max_tokens": max_tokens, "temperature": 0}
    return message


def exchange(endpoint: str) -> list[tuple[str, Any]]:
    """Run the worked exchange against the server at `endpoint`: the frames, in order
    (a client frame that is not msgpack stays `bytes`)."""
    wire = _Wire(endpoint)
    try:
        wire.send({"type": "hello", "protocol_version": 1, "client_name": "docs"})
        wire.receive()
        wire.send({"type": "generate", "rid": "g1", "input": {"text": "The capital of France is"},
                   "sampling": {"max_tokens": 6, "temperature": 0}, "stream": True})
        wire.until_final()
        wire.send({"type": "open_session", "rid": "s1"})
        session = wire.receive()["session"]
        wire.send(_turn("t1", session, "Name a colour.", 8))
        wire.until_final()
        wire.send(_turn("t2", session, "And another?", 4, stream=True))
        wire.until_final()
        wire.send({"type": "fork_session", "rid": "f1", "session": session})
        fork = wire.receive()["sessions"][0]
        wire.send(_turn("t3", fork, "Now a fruit.", 8))
        wire.until_final()
        wire.send({"type": "list_sessions", "rid": "l1"})
        wire.receive()
        wire.send({"type": "close_session", "rid": "c1", "session": fork})
        wire.receive()
        wire.send({"type": "close_session", "rid": "c2", "session": session})
        wire.receive()
        wire.send({"type": "generate", "rid": "t4", "session": fork, "input": {"text": "Hi"}})
        wire.receive()
        wire.send({"type": "generate", "rid": "t5", "input": {"text": "Hi"},
                   "sampling": {"top_p": 0}})
        wire.receive()
        wire.send({"type": "generate", "rid": "t6", "input": {"text": "Hi"},
                   "sampling": {"temprature": 0}})
        wire.receive()
        wire.send_bytes(NOT_MSGPACK)
        wire.receive()
        return wire.lines
    finally:
        wire.close()


def render(lines: list[tuple[str, Any]]) -> str:
    """The lines as the page shows them, with the page's section comments."""
    out = []
    for direction, message in lines:
        if isinstance(message, bytes):
            text = f"<the {len(message)} bytes {message.hex(' ')}: not msgpack>"
        else:
            text = json.dumps(_rounded(message), ensure_ascii=False)
            comment = _SECTIONS.get((direction, message.get("type"), message.get("rid")))
            if comment:
                out.append(("\n" if out else "") + comment)
        out.append(f"{direction}: {text}")
    return "\n".join(out)


def _rounded(value: Any) -> Any:
    """Floats (idle times) to milliseconds, for reading; everything else as received."""
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


_SECTIONS = {
    ("C", "hello", None): "# handshake",
    ("C", "generate", "g1"): "# a streamed generation (greedy, 6 tokens)",
    ("C", "open_session", "s1"): "# a session: open it, two turns, fork it, a turn on the fork",
    ("C", "generate", "t4"): "# errors",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="default", help="model to start (default: %(default)s)")
    args = p.parse_args(argv)
    if args.endpoint:
        print(render(exchange(args.endpoint)))
        return 0
    import radixlm as rl  # only to start (and stop) the server

    with rl.Engine(args.model, device="cpu") as engine:
        print(render(exchange(engine.endpoint)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
