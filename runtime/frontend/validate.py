"""Checks on client requests that need no tokenizer: they run on the frontend's main
thread as a message arrives, before anything is queued for the engine.

Each check raises `RequestError` (the runtime's one refusal type, shared with the engine)
with a stable `ErrorCode`; the frontend turns it into an `Error` reply for the request's
rid.
"""

from __future__ import annotations

from radixlm.runtime.protocol import MAX_N, ErrorCode, Generate, Input, SamplingParams
from radixlm.runtime.rules import RequestError
from radixlm.runtime.sampling_params import validate_sampling


def check_input(inp: Input, vocab_size: int) -> None:
    """Exactly one of text / input_ids / messages, and ids inside the vocabulary."""
    given = [name for name in ("text", "input_ids", "messages") if getattr(inp, name) is not None]
    if len(given) != 1:
        raise RequestError(
            ErrorCode.INVALID_PARAMS,
            f"input needs exactly one of text, input_ids, messages (got {given or 'none'})",
        )
    ids = inp.input_ids
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise RequestError(
            ErrorCode.INVALID_PARAMS, f"input_ids must be in [0, {vocab_size}), got {bad}"
        )
    check_messages(inp)


def check_input_size(inp: Input | None, max_bytes: int, context_length: int) -> None:
    """Refuse, before any tokenizing, an input that cannot fit the context whatever its
    tokens: more ids than the context, or more text bytes than `max_bytes` (the context
    times the longest token's bytes, with a margin). Characters are counted first (never
    more than bytes), so a huge text costs no encoding."""
    if inp is None or max_bytes <= 0:
        return
    if inp.input_ids is not None and len(inp.input_ids) > context_length:
        raise RequestError(ErrorCode.TOO_LONG, f"input ({len(inp.input_ids)} tokens) exceeds "
                                               f"the context length ({context_length})")
    texts = [inp.text] if inp.text is not None else [m.content or "" for m in inp.messages or ()]
    chars = sum(len(t) for t in texts)
    if chars * 4 <= max_bytes:  # UTF-8: at most 4 bytes a character
        return
    size = chars if chars > max_bytes else sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > max_bytes:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"input text ({size} UTF-8 bytes{' at least' if size == chars else ''}) is longer "
            f"than any text that fits the context of {context_length} tokens")


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    problem = validate_sampling(sampling, vocab_size)
    if problem is not None:
        raise RequestError(ErrorCode.INVALID_PARAMS, problem)


def check_messages(inp: Input) -> None:
    for i, m in enumerate(inp.messages or ()):
        if m.content is None and not m.tool_calls:
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"messages[{i}] ({m.role}) has no content"
            )


def check_count(name: str, n: int, limit: int = MAX_N) -> None:
    if not 1 <= n <= limit:
        raise RequestError(ErrorCode.INVALID_PARAMS, f"{name} must be in [1, {limit}], got {n}")


def check_generate(msg: Generate, vocab_size: int) -> None:
    """Everything about a Generate that can be judged before tokenization."""
    check_count("n", msg.n)
    check_sampling(msg.sampling, vocab_size)
    check_input(msg.input, vocab_size)
    start = msg.prompt_logprobs_start
    if start is not None and start < 0:
        raise RequestError(
            ErrorCode.INVALID_PARAMS, f"prompt_logprobs_start must be >= 0, got {start}"
        )


def check_prompt_length(
    n_prompt: int, sampling: SamplingParams, context_length: int, *, in_session: bool,
    prompt_logprobs_start: int | None = None,
) -> None:
    """After tokenization. A session turn's prompt is history + input, which only the
    engine knows: it checks those (and the pool size) itself."""
    if in_session:
        return
    if n_prompt == 0:
        raise RequestError(ErrorCode.EMPTY_PROMPT, "the prompt is empty")
    if n_prompt + sampling.max_tokens > context_length:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"prompt ({n_prompt} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"context length ({context_length})",
        )
    if prompt_logprobs_start is not None and prompt_logprobs_start >= n_prompt:
        raise RequestError(
            ErrorCode.INVALID_PARAMS,
            f"prompt_logprobs_start ({prompt_logprobs_start}) must be below the prompt "
            f"length ({n_prompt})",
        )
