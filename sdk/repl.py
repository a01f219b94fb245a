"""``radixlm chat``: a multi-turn chat REPL on one engine session.

    radixlm chat                          # the running default server, else the embedded model
    radixlm chat --endpoint ipc://...     # a running `radixlm serve` (also $RADIXLM_ENDPOINT)
    radixlm chat --model path/to/model    # start this model for the chat
    radixlm chat --message "Hi" --message "And then?"   # scripted, non-interactive

Each turn appends only the new user message to the session; the status line after each
reply shows how much of the prompt the engine served from its cache. Commands: ``/help``,
``/reset`` (a new session), ``/stats`` (the engine's counters), ``/exit``.

On a terminal, lines are edited with readline (arrows, history search), and the history
is kept in ``$XDG_STATE_HOME/radixlm/chat_history`` (``~/.local/state/...``). Ctrl-C
during a reply stops it (the engine aborts it; the chat goes on); at the prompt, Ctrl-C
twice in a row, Ctrl-D or ``/exit`` leaves. An engine this REPL started runs in a session
of its own (Ctrl-C never reaches it) and stops when the REPL exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from radixlm.runtime.transport.curve import add_key_arguments
from radixlm.runtime.transport.discovery import default_server
from radixlm.sdk.errors import EngineDeadError, EngineError, NoServerError
from radixlm.sdk.sync import ChatSession, Client, connect

__all__ = ["COMMANDS", "build_parser", "main"]

# What the REPL does with a line that is one of these, instead of sending it.
COMMANDS = {
    "/help": "list these commands",
    "/reset": "start a new session (the history is dropped)",
    "/stats": "the engine's counters: sessions, cache hit rate, free KV",
    "/exit": "leave (also /quit, Ctrl-D, or Ctrl-C twice at the prompt)",
}
HISTORY_LENGTH = 1000
STARTING_SERVER_WAIT_S = 600.0  # a default server still loading its model is waited for
EXIT_HINT = "(Ctrl-C again, Ctrl-D or /exit to leave)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixlm chat", allow_abbrev=False,
                                description="Chat with a model on a radixlm engine session "
                                            "(each turn reuses the whole history).")
    p.add_argument("-m", "--model", default=None,
                   help="start this model for the chat: 'default' (SmolLM2-135M-Instruct), "
                        "an HF directory or a .gguf (default: the running default server "
                        "if there is one, else 'default')")
    p.add_argument("--endpoint", default=None,
                   help="attach to a running `radixlm serve` at this endpoint (default: "
                        "$RADIXLM_ENDPOINT, else the default server if one runs)")
    add_key_arguments(p)
    p.add_argument("--system", default="You are a helpful assistant. Answer briefly.",
                   help="system prompt (default: %(default)r)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="most tokens per reply (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--message", action="append", default=None, metavar="TEXT",
                   help="send this message instead of reading stdin (repeatable; exits after)")
    p.add_argument("--device", default=None, help="device for a started engine (cpu, cuda)")
    p.add_argument("--dtype", default=None, help="dtype for a started engine (see serve)")
    p.add_argument("--history-file", default=None, metavar="PATH",
                   help="where the line history is kept (default: "
                        "$XDG_STATE_HOME/radixlm/chat_history)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _open_backend(args: argparse.Namespace) -> Client:
    """The server named (--endpoint, $RADIXLM_ENDPOINT), else the running default server
    unless --model names one to start, else the embedded model, started here."""
    keys = {"server_key": args.server_key, "client_key": args.client_key}
    if args.endpoint or os.environ.get("RADIXLM_ENDPOINT", "").strip():
        return connect(args.endpoint, **keys)
    if args.model is None:
        record = default_server()
        wait: dict[str, float] = {}
        if record is not None and not record.ready:
            print(f"waiting for the default server (pid {record.pid}) to finish starting",
                  file=sys.stderr, flush=True)
            wait["connect_timeout"] = STARTING_SERVER_WAIT_S
        with contextlib.suppress(NoServerError):
            client = connect(**keys, **wait)
            print(f"connected to the default server at {client.endpoint}", file=sys.stderr)
            return client
    if args.server_key or args.client_key:
        raise NoServerError("--server-key/--client-key are for a running server (--endpoint)")
    from radixlm.sdk.engine import Engine

    flags = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v}
    return Engine(args.model or "default", **flags)


def _print_stats(backend: Client) -> None:
    stats = backend.stats()
    print(f"  sessions {stats['sessions']}, cache hit rate {stats['hit_rate']:.0%}, "
          f"KV free {stats['free']}/{stats['capacity']}")


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


class _Prompt:
    """Lines typed at ``> ``: readline editing and a history file on a terminal; Ctrl-C at
    the prompt twice in a row ends the input (once: a hint), as Ctrl-D does."""

    def __init__(self, history_file: str | None) -> None:
        self.interactive = sys.stdin.isatty()
        self.history: Path | None = None
        self._readline: Any = None
        if self.interactive:
            try:
                import readline
            except ImportError:  # a Python without it: plain input()
                return
            self._readline = readline
            self.history = Path(history_file) if history_file else _default_history()
            readline.set_history_length(HISTORY_LENGTH)
            with contextlib.suppress(OSError):
                readline.read_history_file(self.history)

    def lines(self) -> Iterator[str]:
        interrupted = False
        while True:
            try:
                try:
                    line = input("> ")
                except KeyboardInterrupt:
                    if interrupted:
                        print()
                        return
                    interrupted = True
                    print(f"\n{EXIT_HINT}")
                    continue
            except KeyboardInterrupt:  # the second one came while the first was answered
                print()
                return
            except EOFError:
                print()
                return
            interrupted = False
            yield line

    def save(self) -> None:
        if self._readline is None or self.history is None:
            return
        with contextlib.suppress(OSError):
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self._readline.write_history_file(self.history)


def _default_history() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".local", "state")
    return Path(state) / "radixlm" / "chat_history"


def _scripted(messages: list[str]) -> Iterator[str]:
    for m in messages:
        print(f"> {m}")
        yield m


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _chat(args)
    except KeyboardInterrupt:  # while starting or connecting: leave quietly
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"radixlm chat: {e}", file=sys.stderr)
        return 1


def _chat(args: argparse.Namespace) -> int:
    try:
        backend = _open_backend(args)
    except (EngineError, ValueError) as e:
        print(f"radixlm chat: {e}", file=sys.stderr)
        return 1
    out = sys.stdout
    prompt = _Prompt(args.history_file) if args.message is None else None
    with backend:
        chat = backend.session(system=args.system).open()
        try:
            print(f"chatting with {backend.model} (/help for commands)", file=sys.stderr)
            for line in prompt.lines() if prompt is not None else _scripted(args.message):
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
                try:
                    if text == "/stats":
                        _print_stats(backend)
                    else:
                        _turn(chat, text, args, out)
                except KeyboardInterrupt:  # a reply is aborted in the engine
                    print("\n(interrupted)")
                except EngineError as e:
                    print(f"\nerror: {e}", file=sys.stderr)
                    if isinstance(e, EngineDeadError):
                        return 1
        finally:
            if prompt is not None:
                prompt.save()
            if backend.alive:
                chat.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
