"""The OpenAI Python SDK against radixlm's HTTP API: a chat completion, a streamed one,
and a conversation continued with the Responses API's ``previous_response_id``, whose
history stays in the engine's cache (watch ``cached_tokens`` grow with the history).

    python examples/openai_client.py                      # starts rl.Engine(http=...)
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1   # a running server
"""

from __future__ import annotations

import argparse
import sys

import openai


def run(client: openai.OpenAI, model: str, max_tokens: int, turns: list[str]) -> None:
    chat = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Name a prime number."}])
    print("chat:", chat.choices[0].message.content)
    print("streamed: ", end="")
    for chunk in client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0, stream=True,
            messages=[{"role": "user", "content": "Say hello."}]):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
    previous = None
    for text in turns:  # each turn sends only its new message
        r = client.responses.create(model=model, input=text, previous_response_id=previous,
                                    instructions="You are terse." if previous is None else None,
                                    max_output_tokens=max_tokens, temperature=0)
        print(f"> {text}\n{r.output_text}\n  [input {r.usage.input_tokens} tokens, "
              f"{r.usage.input_tokens_details.cached_tokens} cached]")
        previous = r.id


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None,
                   help="a running radixlm HTTP API (…/v1); default: start rl.Engine(http=...)")
    p.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    p.add_argument("--model", default=None, help="model id (default: the server's only one)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--turn", action="append", default=None, help="a user turn (repeatable)")
    args = p.parse_args()
    turns = args.turn or ["Pick a colour.", "Why that one?", "And a second choice?"]
    engine = None
    base_url = args.base_url
    if base_url is None:
        import radixlm as rl

        print("starting the engine (SmolLM2-135M-Instruct) ...", file=sys.stderr, flush=True)
        engine = rl.Engine(http="127.0.0.1:8000")
        base_url = engine.http_url
    try:
        client = openai.OpenAI(base_url=base_url, api_key=args.api_key)
        model = args.model or client.models.list().data[0].id
        run(client, model, args.max_tokens, turns)
    finally:
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
