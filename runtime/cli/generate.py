"""``radixlm generate "prompt"``: one generation, streamed to stdout.

The server: ``--endpoint``, else ``$RADIXLM_ENDPOINT``, else the default server when one
runs; with ``--model`` (or when none runs) one is started for this request, behind a
spinner on a terminal, and stopped afterwards. The prompt goes through the model's chat
template as a user message (``--raw``: completed as plain text; a model without a
template gets the plain text). Ctrl-C aborts the generation and exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from typing import Any

import zmq
from radixlm.runtime.cli.common import (
    StopRequested,
    find_server,
    key_options,
    say,
    setup_logging,
    stop_on_sigterm,
)
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.protocol import Abort, Chunk, ErrorCode, Input, Message
from radixlm.runtime.server.launcher import (
    RunningServer,
    ServerStartError,
    connect_address,
    start_server,
)
from radixlm.runtime.server.progress import Spinner, starting_label
from radixlm.runtime.transport.channel import EndpointError
from radixlm.runtime.transport.discovery import client_endpoint
from radixlm.runtime.transport.errors import EngineError
from radixlm.runtime.transport.probe import NoServerError
from radixlm.runtime.transport.raw_client import RawClient

__all__ = ["run_generate"]

HANDSHAKE_TIMEOUT_S = 60.0
ABORT_WAIT_S = 2.0


def _server_to_use(args: argparse.Namespace) -> str | None:
    """The running server's endpoint, or None: start one. Raises `NoServerError` for an
    endpoint that was named (by flag or environment) where nothing listens."""
    if args.endpoint is not None:
        return find_server(args.endpoint)
    if args.model is not None:
        return None  # a model was named: run it
    _, source = client_endpoint(None)
    if source != "the default server":
        return find_server(None)  # $RADIXLM_ENDPOINT: it must be there
    try:
        return find_server(None)
    except NoServerError:
        return None  # no default server: start the embedded model


def _inputs(args: argparse.Namespace) -> list[Input]:
    """What to send, in order of preference (the plain text after a template refusal)."""
    raw = Input(text=args.prompt)
    if args.raw:
        return [raw]
    messages = [Message(role="user", content=args.prompt)]
    if args.system is not None:
        messages.insert(0, Message(role="system", content=args.system))
    return [Input(messages=messages), raw]


def run_generate(args: argparse.Namespace, config: EngineConfig) -> int:
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.raw and args.system is not None:
        say("generate", "--system needs the chat template: it cannot go with --raw")
        return 2
    options = key_options(args, "generate")
    if options is None:
        return 2
    try:
        endpoint = _server_to_use(args)
    except NoServerError as e:
        say("generate", e.message)
        return 1
    if options and endpoint is None:
        say("generate", "--server-key/--client-key need a running server (--endpoint); a "
                        "server started for this request needs no keys")
        return 2
    server: RunningServer | None = None
    try:
        if endpoint is None:
            setup_logging(args.log_level)
            with Spinner(starting_label(config.model)):
                server = start_server(config, start_timeout_s=args.start_timeout)
            endpoint = server.endpoint
        return _generate(connect_address(endpoint), args, options)
    except (ServerStartError, EndpointError) as e:
        say("generate", str(e))
        return 1
    except (KeyboardInterrupt, StopRequested):
        return 130
    finally:
        if server is not None:
            server.stop()


def _abort(client: RawClient, rid: str) -> None:
    """Abort `rid` and wait (briefly) for its end, so the abort is not lost with the
    socket (which closes without lingering)."""
    client.send(Abort(rid=rid))
    with contextlib.suppress(EngineError, TimeoutError):
        client.collect(rid, timeout_s=ABORT_WAIT_S)


def _generate(endpoint: str, args: argparse.Namespace, options: dict[int, Any]) -> int:
    try:
        with RawClient(endpoint, name="radixlm-cli", options=options,
                       timeout_s=HANDSHAKE_TIMEOUT_S) as client:
            inputs = _inputs(args)
            for i, inp in enumerate(inputs):
                rid = client.new_rid("gen")
                waiting = Spinner("waiting for the reply")  # (on a terminal, until text comes)

                def show(chunk: Chunk, waiting: Spinner = waiting) -> None:
                    waiting.stop()
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()

                try:
                    waiting.start()
                    client.generate(inp, rid=rid, stream=True, timeout_s=None, on_chunk=show,
                                    max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_p=args.top_p, stop=args.stop)
                except EngineError as e:
                    if e.code == ErrorCode.NO_TEMPLATE and i + 1 < len(inputs):
                        continue  # not a chat model: complete the plain text
                    raise
                except BaseException:  # Ctrl-C, SIGTERM: stop the generation first
                    _abort(client, rid)
                    raise
                finally:
                    waiting.stop()
                break
            sys.stdout.write("\n")
        return 0
    except EngineError as e:
        say("generate", f"{e.code}: {e.message}")
        return 1
    except (TimeoutError, OSError, zmq.ZMQError) as e:
        say("generate", str(e))
        return 1
