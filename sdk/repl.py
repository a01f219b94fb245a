"""``radixlm chat``: a multi-turn chat REPL on one engine session.

    radixlm chat                          # starts the embedded default model
    radixlm chat --endpoint ipc://...     # talks to a running `radixlm serve`
    radixlm chat --message "Hi" --message "And then?"   # scripted, non-interactive

Each turn appends only the new user message to the session; the status line after each
reply shows how much of the prompt the engine served from its cache. Commands: ``/help``,
``/reset`` (a new session), ``/stats`` (the engine's counters), ``/exit``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TextIO

from radixlm.sdk.errors import EngineError
from radixlm.sdk.sync import ChatSession, Client, connect

__all__ = ["COMMANDS", "build_parser", "main"]

# What the REPL does with a line that is one of these, instead of sending it.
COMMANDS = {
    "/help": "list these commands",
    "/reset": "start a new session (the history is dropped)",
    "/stats": "the engine's counters: sessions, cache hit rate, free KV",
    "/exit": "leave (also /quit, or end of input)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixlm chat", description="Chat with a model on a "
                                "radixlm engine session (each turn reuses the whole history).")
    p.add_argument("--model", default="default",
                   help="model to start when no --endpoint is given: 'default' "
                        "(SmolLM2-135M-Instruct), an HF directory or a .gguf (default: %(default)s)")
    p.add_argument("--endpoint", default=None,
                   help="attach to a running `radixlm serve` at this endpoint instead")
    p.add_argument("--system", default="You are a helpful assistant. Answer briefly.",
                   help="system prompt (default: %(default)r)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="most tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--message", action="append", default=None, metavar="TEXT",
                   help="send this message instead of reading stdin (repeatable; exits after)")
    p.add_argument("--device", default=None, help="device for a started engine (cpu, cuda)")
    return p


def _open_backend(args: argparse.Namespace) -> Client:
    if args.endpoint:
        return connect(args.endpoint)
    from radixlm.sdk.engine import Engine

    flags = {"device": args.device} if args.device else {}
    print(f"starting the engine ({args.model}) ...", file=sys.stderr, flush=True)
    return Engine(args.model, **flags)


def _turn(chat: ChatSession, text: str, args: argparse.Namespace, out: TextIO) -> None:
    start = time.perf_counter()
    with chat.stream(text, max_tokens=args.max_tokens, temperature=args.temperature) as s:
        for delta in s:
            out.write(delta.text)
            out.flush()
    meta = s.result.meta_info
    elapsed = time.perf_counter() - start
    prompt, cached = meta["prompt_tokens"], meta["cached_tokens"]
    share = cached / prompt if prompt else 0.0
    out.write(f"\n  [{meta['completion_tokens']} tokens in {elapsed:.1f} s | prompt {prompt} "
              f"tokens, {cached} cached ({share:.0%})]\n")


def _lines(args: argparse.Namespace) -> Iterable[str]:
    if args.message is not None:
        for m in args.message:
            print(f"> {m}")
            yield m
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        backend = _open_backend(args)
    except EngineError as e:
        print(f"radixlm chat: {e}", file=sys.stderr)
        return 1
    out = sys.stdout
    with backend:
        chat = backend.session(system=args.system).open()
        try:
            print(f"chatting with {backend.model} (/help for commands)", file=sys.stderr)
            for line in _lines(args):
                text = line.strip()
                if not text:
                    continue
                if text in ("/exit", "/quit"):
                    break
                if text == "/help":
                    for command, what in COMMANDS.items():
                        print(f"  {command:<8} {what}")
                    continue
                if text == "/reset":
                    chat.close()
                    chat = backend.session(system=args.system).open()
                    print("(new session)")
                    continue
                if text == "/stats":
                    stats = backend.stats()
                    print(f"  sessions {stats['sessions']}, cache hit rate "
                          f"{stats['hit_rate']:.0%}, KV free {stats['free']}/{stats['capacity']}")
                    continue
                try:
                    _turn(chat, text, args, out)
                except KeyboardInterrupt:
                    print("\n(interrupted)")
                except EngineError as e:
                    print(f"\nerror: {e}", file=sys.stderr)
                    if e.code == "engine_dead":
                        return 1
        finally:
            if backend.alive:
                chat.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
