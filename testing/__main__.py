"""``python -m radixlm.testing --endpoint ENDPOINT``: serve the protocol stub until killed
(the SDK overhead benchmark runs it in a process of its own)."""

from __future__ import annotations

import argparse
import contextlib

from radixlm.testing.stub_server import StubServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixlm.testing",
                                     description="Serve the toy protocol stub until killed.")
    parser.add_argument("--endpoint", required=True, help="ipc:// or tcp:// endpoint to bind")
    parser.add_argument("--token-delay", type=float, default=0.0,
                        help="seconds per generated token (default: %(default)s)")
    args = parser.parse_args(argv)
    stub = StubServer(args.endpoint, token_delay_s=args.token_delay, record=False)
    print(f"stub serving at {stub.endpoint}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stub.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
