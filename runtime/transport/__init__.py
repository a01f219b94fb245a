"""radixlm.runtime.transport: the client side of the engine protocol, shared by every
client process (the SDK and the HTTP server), so that neither depends on the other.

- `connection`: `Connection`, one engine connection (handshake, replies routed by rid,
  heartbeat, deferred session closes) and `check_endpoint`.
- `request`: `Request`, one in-flight request's replies.
- `zmtp`: a ZeroMQ DEALER spoken directly on the asyncio loop (ZMTP 3.1, NULL security);
  `zmq_dealer`: pyzmq's DEALER, for other loops, other endpoint schemes and CURVE.
- `mailbox`: `Mailbox` and `Latch`, the cheap one-loop queue and flag the hot paths use.
- `curve`: `CurveKeys` / `load_curve_keys`, a client's CurveZMQ keys.
- `errors`: `EngineError` and one class per protocol `ErrorCode` (`error_from_reply`).
- `probe`: `probe_endpoint`, whether anything listens (asked before a client waits);
  `discovery`: where a user's default server is (``$RADIXLM_ENDPOINT``, the default
  server's socket and lock), `find_server`.
- `channel`: the ZeroMQ helper of every process (endpoints, sockets, framed messages);
  `raw_client`: a blocking client for the CLI, scripts and tests; `curve_keys`: a
  server's CurveZMQ keys (``radixlm keys``, ``serve --auth-dir``).

It imports the protocol module (`radixlm.runtime.protocol`) and nothing else of ours:
never torch, the engine, the frontend or the SDK.
"""
