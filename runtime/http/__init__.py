"""radixlm's OpenAI-compatible HTTP frontend: /v1/chat/completions, /v1/completions,
/v1/responses (stored responses are engine sessions), /v1/models, /health, /metrics.

It is one more protocol client of the engine, like the SDK: it imports the wire protocol
and the SDK's transport, never torch. ``radixlm serve --http HOST:PORT`` starts it beside
the ZeroMQ endpoint; ``python -m radixlm.runtime.http --engine ENDPOINT`` attaches it to a
running server. See docs/http.md.
"""
