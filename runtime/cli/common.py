"""What the `radixlm` commands share: logging, SIGTERM, CURVE key options, finding the
server a client command talks to (`find_server`, from `radixlm.runtime.transport.discovery`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

from radixlm.runtime.transport.discovery import find_server

__all__ = ["StopRequested", "find_server", "key_options", "say", "setup_logging",
           "stop_on_sigterm", "write_endpoint_file"]


class StopRequested(BaseException):
    """SIGTERM: stop like Ctrl-C does (a BaseException, as KeyboardInterrupt is: the
    `except Exception` that keeps a server serving past one request's bug must not swallow
    it; once the router did, and ran on after SIGTERM)."""


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise StopRequested


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s radixlm %(levelname)s %(message)s")


def say(command: str, message: str) -> None:
    """One line on stderr, prefixed with the command."""
    print(f"radixlm {command}: {message}", file=sys.stderr, flush=True)


def write_endpoint_file(path: str, endpoint: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".endpoint-", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(endpoint + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


def key_options(args: argparse.Namespace, command: str) -> dict[int, Any] | None:
    """The CURVE socket options --server-key/--client-key name ({} without them); None
    after printing why they cannot be used."""
    from radixlm.runtime.transport.curve import load_curve_keys

    try:
        keys = load_curve_keys(args.server_key, args.client_key,
                               names=("--server-key", "--client-key"))
    except ValueError as e:
        say(command, str(e))
        return None
    return keys.socket_options() if keys is not None else {}
