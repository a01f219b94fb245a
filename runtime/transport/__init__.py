"""radixlm.runtime.transport: the client side of the engine protocol, written once and
shared by every client process (the SDK, the HTTP server, the router's links to its
replicas, the CLI), so that none depends on another.

- `client`: `ProtocolClient`, the one protocol-client core: request ids, `call` (one
  answer of the type expected, errors as typed exceptions), `request` / `run_generate`
  (a Generate's chunks and its n Dones), the sessions, pins, stats and tokenizing
  requests. The SDK's `AsyncClient` and the HTTP process's `EngineLink` are built on it.
- `connection`: `Connection`, one engine connection under it (handshake, replies routed
  by rid, heartbeat, deferred session closes); `request`: `Request`, one in-flight
  request's replies.
- `exchange`: a request and its replies with no I/O (`Rids`, `hello`, `Replies`,
  `unexpected`): the rules the async core, the blocking `raw_client.RawClient` (the CLI's,
  scripts' and tests') and the router's replica links share.
- `endpoints`: `parse_endpoint`, the one reader of endpoint syntax (ipc://, tcp://,
  inproc://) for every client, the probe, the server's bind rules and the router.
- `zmtp`: a ZeroMQ DEALER spoken directly on the asyncio loop (ZMTP 3.1, NULL security);
  `zmq_dealer`: pyzmq's DEALER, for other loops, other endpoint schemes and CURVE.
- `mailbox`: `Mailbox` and `Latch`, the cheap one-loop queue and flag the hot paths use.
- `curve`: `CurveKeys` / `load_curve_keys`, a client's CurveZMQ keys.
- `errors`: `EngineError` and one class per protocol `ErrorCode` (`error_from_reply`).
- `probe`: `probe_endpoint`, whether anything listens (asked before a client waits);
  `discovery`: where a user's default server is (``$RADIXLM_ENDPOINT``, the default
  server's socket and lock), `find_server`.
- `channel`: the ZeroMQ helper of every process (runtime directories, the bind rules,
  `open_socket` with radixlm's options and heartbeats for every libzmq socket, framed
  messages); `curve_keys`: a server's CurveZMQ keys (``radixlm keys``, ``serve
  --auth-dir``).

It imports the protocol module (`radixlm.runtime.protocol`) and nothing else of ours:
never torch, the engine, the frontend or the SDK.
"""
