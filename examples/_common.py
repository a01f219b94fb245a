"""Shared plumbing of the examples: which engine to run on, and the cache report."""

from __future__ import annotations

import argparse
import sys

import radixlm as rl


def parser(description: str, *, max_tokens: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="default",
                   help="model to start: 'default' (SmolLM2-135M-Instruct), an HF directory "
                        "or a .gguf file (default: %(default)s)")
    p.add_argument("--endpoint", default=None,
                   help="use the running `radixlm serve` at this endpoint instead of starting one")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most tokens per generation (default: %(default)s)")
    p.add_argument("--device", default=None, help="device of a started engine (cpu, cuda)")
    return p


def open_backend(args: argparse.Namespace) -> rl.Client:
    """A client of the engine the flags name: attached to --endpoint, or a new rl.Engine."""
    if args.endpoint:
        return rl.connect(args.endpoint)
    print(f"starting the engine ({args.model}) ...", file=sys.stderr, flush=True)
    return rl.Engine(args.model, **({"device": args.device} if args.device else {}))


def cache_report(stats: dict) -> str:
    """How much of all prompts the engine served from its prefix cache so far."""
    return (f"cache hit rate {stats['hit_rate']:.0%} ({stats['cached_tokens_total']} of "
            f"{stats['prompt_tokens_total']} prompt tokens served from the cache)")
