"""JSON Schema of every wire message, generated from the msgspec types in `protocol`.

The schema is what clients in other languages validate against and generate code from;
``docs/protocol.schema.json`` is this module's output, committed (``make schema``
regenerates it, a test fails when it is stale). It describes each message as the
msgpack map it is on the wire: JSON Schema's ``object``/``array``/``string``/``integer``/
``number``/``boolean``/``null`` map one to one onto msgpack's map/array/str/int/float/
bool/nil.

Deterministic: the same protocol module always yields the same dict (and text).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from radixlm.runtime import protocol

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_REF_TEMPLATE = "#/$defs/{name}"


def _error_codes() -> list[str]:
    return sorted(
        value
        for name, value in vars(protocol.ErrorCode).items()
        if not name.startswith("_") and isinstance(value, str)
    )


def protocol_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every message a client or the engine sends.

    The root accepts any message in either direction; ``$defs/ClientMessage`` and
    ``$defs/ServerMessage`` are the two tagged unions (discriminated by ``"type"``), and
    every struct has its own entry under ``$defs``.
    """
    (client, server), components = msgspec.json.schema_components(
        [protocol.ClientMessage, protocol.ServerMessage], ref_template=_REF_TEMPLATE
    )
    client["title"] = "ClientMessage"
    client["description"] = "A message a client sends (client DEALER -> engine ROUTER)."
    server["title"] = "ServerMessage"
    server["description"] = "A message the engine sends (engine ROUTER -> client DEALER)."
    defs = {"ClientMessage": client, "ServerMessage": server}
    defs.update(sorted(components.items()))
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "radixlm wire protocol",
        "description": (
            'One msgpack-encoded map per ZeroMQ frame; the "type" field names the '
            "message. See docs/protocol.md."
        ),
        "x-protocol-version": protocol.PROTOCOL_VERSION,
        "x-error-codes": _error_codes(),
        "anyOf": [
            {"$ref": _REF_TEMPLATE.format(name=name)} for name in ("ClientMessage", "ServerMessage")
        ],
        "$defs": defs,
    }


def protocol_schema_json() -> str:
    """`protocol_schema()` as the text committed at ``docs/protocol.schema.json``."""
    return json.dumps(protocol_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    print(protocol_schema_json(), end="")
