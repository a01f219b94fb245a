"""radixlm's OpenAI-compatible HTTP frontend: /v1/chat/completions, /v1/completions,
/v1/responses (stored responses are engine sessions) and /v1/conversations with their
items, /v1/sessions (radixlm's chat sessions), /v1/models, /v1/tokenize and
/v1/detokenize (also without /v1), /get_model_info, /health and /metrics: the full list
is `app.build_app`'s, and docs/http.md says what each does.

It is one more protocol client of the engine, like the SDK: it imports the wire protocol
and the SDK's transport, never torch. ``radixlm serve --http HOST:PORT`` starts it beside
the ZeroMQ endpoint; ``python -m radixlm.runtime.http --engine ENDPOINT`` attaches it to a
running server. See docs/http.md.
"""
