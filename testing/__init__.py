"""``radixlm.testing``: test radixlm programs and clients without a model.

`StubServer` is a stand-in engine speaking the radixlm protocol (no model, no torch), for
tests of programs and clients and for measuring the SDK's own overhead. It behaves as the
engine does wherever a client can tell: tests/protocol/test_stub_conformance.py runs one
suite against both.

It binds a ROUTER socket and answers every client message the way the engine does, over
a toy model:

- tokens are characters (token id = code point, EOS = 0); chat messages render as ChatML
  text, appended messages as a delta that first closes an assistant turn left open;
- the next token and every logprob are deterministic functions of the last few tokens
  (a sampled request, ``temperature > 0``, is shifted by its ``seed``, 0 if none, plus its
  branch index: seeds act as in the engine), so results can be recomputed independently
  (`toy_next_token`, `toy_logprob`);
- a prefix trie of every sequence it has "computed" gives ``usage.cached_tokens`` as a
  radix cache would; sessions, forks, pins, busy/ownership errors follow the protocol;
- `token_delay_s` paces generation (one token per branch per delay), to observe
  concurrency and cancellation; ``0`` answers at once (for SDK overhead benchmarks).

    with StubServer() as stub:
        with rl.connect(stub.endpoint) as client: ...

``python -m radixlm.testing --endpoint ipc:///tmp/x.sock`` serves until killed.

Its parts: `toy_model` (the toy model and template), `stub_state` (sessions, pins, the
prefix trie), `stub_sessions` and `stub_generation` (the answers to session and pin
messages, and to Generate and Abort), `stub_server` (the socket, loop and handshake).
"""

from radixlm.testing.stub_server import StubServer
from radixlm.testing.toy_model import (
    CONTEXT_LENGTH,
    EOS,
    IM_END,
    IM_START,
    render_chatml,
    toy_logprob,
    toy_next_token,
)

__all__ = [
    "CONTEXT_LENGTH", "EOS", "IM_END", "IM_START", "StubServer", "render_chatml",
    "toy_logprob", "toy_next_token",
]
