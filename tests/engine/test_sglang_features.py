"""SGLang's request features in the engine, against independent references.

- ``min_tokens`` (SGLang's ``min_new_tokens``): EOS and stop ids are masked until the
  output has that many tokens; stop strings still end it. Reference: transformers'
  greedy decoding with its own `MinNewTokensLengthLogitsProcessor`.
- ``stop_regex``: the output ends at the first token after which its text matches
  (``re.search``); SGLang's detokenizer then cuts the text where the pattern's characters
  occur literally (``str.find``), so a literal pattern trims like a stop string and a
  real regex's match stays. Reference: ``re`` over the text of every output prefix, as
  `tokenizers` decodes it.
- ``prompt_logprobs_start`` counting back into a session's history (SGLang's
  ``logprob_start_len`` over a program's whole text). Reference: transformers' logprobs
  of the whole sequence.
"""

from __future__ import annotations

import re

import numpy as np
import scheduler_harness as harness
import torch
from radixlm.runtime.engine.wire import EngineOpenSession
from radixlm.runtime.protocol import Error, ErrorCode, SamplingParams, SessionOpened
from scheduler_harness import hf_greedy, hf_prompt_logprobs, output_text, random_prompt
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity


def hf_greedy_min_tokens(hf, prompt: list[int], n: int, min_new: int, stops: list[int]) -> list[int]:
    """transformers' greedy decoding under its MinNewTokensLengthLogitsProcessor, ending at
    (and including) the first of `stops`."""
    process = MinNewTokensLengthLogitsProcessor(len(prompt), min_new, stops)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            scores = hf(torch.tensor([ids])).logits[:, -1].float()
            tok = int(process(torch.tensor([ids]), scores)[0].argmax())
            ids.append(tok)
            if tok in stops:
                break
    return ids[len(prompt):]


def _first_new(ref: list[int], at_least: int) -> int:
    """A token of `ref` first generated at index >= `at_least`."""
    return next(t for i, t in enumerate(ref) if i >= at_least and t not in ref[:i])


def test_min_tokens_masks_stop_ids_and_eos_until_reached(make_harness, hf):
    prompt = random_prompt(np.random.default_rng(31), 20)
    ref = hf_greedy(hf, prompt, 16)
    stop = _first_new(ref, 1)
    at = ref.index(stop)
    min_tokens = at + 3  # the stop id would end the output before it
    expected = hf_greedy_min_tokens(hf, prompt, 16, min_tokens, [stop])
    assert len(expected) > at + 1  # the reference itself went past the early stop
    h = make_harness(eos=(stop,))
    k_id = h.generate(prompt, sampling=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
        min_tokens=min_tokens))
    k_eos = h.generate(prompt, sampling=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=False, min_tokens=min_tokens))
    k_plain = h.generate(prompt, sampling=SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))
    h.run()
    for k in (k_id, k_eos):
        assert h.output(k) == expected
        assert len(h.output(k)) >= min_tokens
        final = h.final[(k, 0)]
        if expected[-1] == stop:
            assert (final.finish_reason, final.matched_stop) == ("stop", stop)
        else:
            assert final.finish_reason == "length"
    assert h.output(k_plain) == ref[: at + 1]  # without min_tokens: the early stop
    h.check_quiescent()


def test_a_stop_string_still_ends_the_output_below_min_tokens(make_harness, hf):
    """SGLang masks only stop token ids: a stop string ends the output at any length."""
    prompt = random_prompt(np.random.default_rng(32), 20)
    ref = hf_greedy(hf, prompt, 20)
    h = make_harness()
    stop, kept, _ = harness.stop_inside(h.tokenizer, prompt, ref, 3)
    key = h.generate(prompt, sampling=SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=20))
    h.run()
    final = h.final[(key, 0)]
    assert (final.finish_reason, final.matched_stop) == ("stop", stop)
    assert h.output(key) == ref[:kept] and kept < 20
    h.check_quiescent()


def _clean_piece(text: str, start: int, length: int) -> str | None:
    piece = text[start : start + length]
    if len(piece) < length or "\ufffd" in piece or not piece.strip():
        return None
    return piece


def _first_match(tok, prompt: list[int], ref: list[int], pattern: str) -> int | None:
    """SGLang's rule: the first output length whose text matches `pattern`."""
    return next((k for k in range(1, len(ref) + 1)
                 if re.search(pattern, output_text(tok, prompt, ref[:k]))), None)


def test_stop_regex_ends_at_the_first_token_whose_text_matches(make_harness, hf):
    """A real regex (its characters do not occur literally): the match stays in the text,
    every token up to the one completing it is kept."""
    prompt = random_prompt(np.random.default_rng(33), 20)
    ref = hf_greedy(hf, prompt, 30)
    h = make_harness()
    full = output_text(h.tokenizer, prompt, ref)
    offset = len(output_text(h.tokenizer, prompt, ref[:5]))
    piece = next(p for s in range(offset, len(full)) if (p := _clean_piece(full, s, 2)))
    pattern = f"{re.escape(piece[0])}[^\\n]"  # its first character, then any but a newline
    assert full.find(pattern) == -1  # a class: never literally in the text
    expected = _first_match(h.tokenizer, prompt, ref, pattern)
    assert expected is not None
    key = h.generate(prompt, sampling=SamplingParams(max_tokens=30, temperature=0.0,
                                                     ignore_eos=True, stop_regex=[pattern]))
    h.run()
    final = h.final[(key, 0)]
    assert (final.finish_reason, final.matched_stop) == ("stop", pattern)
    assert h.output(key) == ref[:expected]
    assert final.text_trim == 0
    # Nothing past the kept tokens joined the tree.
    assert h.cache.match(prompt + ref).length <= len(prompt) + expected
    h.check_quiescent()


def test_a_literal_stop_regex_trims_like_a_stop_string(make_harness, hf):
    """A pattern found literally in the text is cut there: the same output, kept tokens
    and trim as that stop string gets (the stop string's own test checks those against
    `tokenizers`), and it ends no later than SGLang's first matching token."""
    prompt = random_prompt(np.random.default_rng(34), 20)  # a piece with no regex syntax
    ref = hf_greedy(hf, prompt, 30)
    h = make_harness()
    stop, kept, _ = harness.stop_inside(h.tokenizer, prompt, ref, 4)
    pattern = re.escape(stop)
    assert pattern == stop, "pick a seed whose stop piece has no regex syntax"
    k_regex = h.generate(prompt, sampling=SamplingParams(max_tokens=30, temperature=0.0,
                                                         ignore_eos=True, stop_regex=[stop]))
    k_stop = h.generate(prompt, sampling=SamplingParams(max_tokens=30, temperature=0.0,
                                                        ignore_eos=True, stop=[stop]))
    h.run()
    regex, string = h.final[(k_regex, 0)], h.final[(k_stop, 0)]
    assert (regex.finish_reason, regex.matched_stop) == ("stop", stop)
    assert h.output(k_regex) == h.output(k_stop) == ref[:kept]
    assert regex.text_trim == string.text_trim
    first = _first_match(h.tokenizer, prompt, ref, pattern)
    assert first is not None and kept <= first
    h.check_quiescent()


def test_prompt_logprobs_reach_back_into_a_session_history(make_harness, hf):
    rng = np.random.default_rng(35)
    history, appended = random_prompt(rng, 30), random_prompt(rng, 8)
    h = make_harness(sessions=True)
    h.send(EngineOpenSession(client=b"c", rid="open", input_ids=history))
    h.run()
    opened = next(m for m in h.replies if isinstance(m, SessionOpened))
    back = 12  # the history's last 12 tokens, then the appended ones
    key = h.generate(appended, max_tokens=1, session=opened.session,
                     prompt_logprobs_start=-back)
    h.run()
    final = h.final[(key, 0)]
    whole = history + appended
    ref = hf_prompt_logprobs(hf, whole, len(history) - back)
    np.testing.assert_allclose(np.asarray(final.prompt_logprobs), ref, atol=2e-4)
    assert final.prompt_token_ids == whole[len(history) - back:]
    # Before the history's start is refused, and the engine goes on serving.
    h.generate(appended, max_tokens=1, session=final.session,
               prompt_logprobs_start=-(len(whole) + 2))
    error = next(m for m in reversed(h.replies) if isinstance(m, Error))
    assert error.code == ErrorCode.INVALID_PARAMS and "prompt_logprobs_start" in error.message
