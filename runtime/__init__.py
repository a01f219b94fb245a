"""radixlm.runtime: everything below the SDK.

Loose modules, each shared by several processes:
- `protocol`: the wire protocol (msgspec messages; docs/protocol.md), and
  `protocol_schema`, its JSON Schema;
- `rules`: every rule a client request can break, and `RequestError`;
- `settings`: how a setting is declared once (help, flags, rule) and what is derived
  from it (the commands' flags, the check of every value);
- `config`: the engine's settings (the frozen `EngineConfig`) and the `Endpoints` a
  server's processes use;
- `memory`: handing freed heap back to the OS once a process is ready.

Packages, by concern (data flows sdk -> transport -> frontend -> engine -> model and back):
- `transport/`: the one protocol-client core (connections, requests, sockets, endpoints,
  CurveZMQ keys, server discovery);
- `frontend/`: tokenize, render templates, detokenize, stream, route clients;
- `engine/`: the scheduler loop, requests, sessions, sampling, the engine's messages;
- `model/`, `attention/`, `grammar/`, `distributed/`: what the engine runs;
- `http/`: the OpenAI-compatible HTTP API (one more protocol client);
- `router/`: one endpoint in front of several engines;
- `server/`: starting, supervising and stopping processes; `cli/`: the `radixlm` commands.
"""
