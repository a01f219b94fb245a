"""SGLang's reply semantics from the real engine (the shared tiny-model server), against
transformers as the reference.

- A matched stop token id: SGLang's detokenizer trims it (``trim_matched_stop`` decodes
  ``output_ids[:-1]``): the text is the text of the tokens before it, while the token ids
  (and the history) keep it.
- ``logprob_texts`` (SGLang's ``return_text_in_logprobs``): every token id a chunk or
  Done carries -- output, top alternatives, prompt -- maps to its text decoded alone
  (SGLang: ``tokenizer.batch_decode`` of each id; here transformers' ``decode([id])``).
- ``Done.prompt_token_ids``: the tokens whose logprobs ``prompt_logprobs`` holds.
- A program's ``logprob_start_len`` counts in its whole text: the second gen's
  ``input_token_logprobs`` reach back into the session's history; as SGLang's scheduler
  lists them (``[None] + logprobs[:-1]``) the first has no logprob, and the others are
  transformers' logprobs of that whole prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import radixlm as rl
import torch
import transformers
from radixlm.runtime.protocol import Chunk, Done, Generate, Input, SamplingParams
from radixlm.runtime.transport.raw_client import RawClient
from tiny_models import load_hf_model

pytestmark = pytest.mark.usefixtures("pool_integrity")

PROMPT = list(range(60, 84))


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return load_hf_model(tiny_model_dir)


def run(c: RawClient, *, stream: bool = False, logprob_texts: bool = False,
        prompt_logprobs_start: int | None = None, input_ids: list[int] = PROMPT,
        **sampling: Any) -> tuple[list[Chunk], Done]:
    rid = c.new_rid("g")
    c.send(Generate(rid=rid, input=Input(input_ids=input_ids),
                    sampling=SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
                    stream=stream, logprob_texts=logprob_texts,
                    prompt_logprobs_start=prompt_logprobs_start))
    chunks: list[Chunk] = []
    done = c.collect(rid, on_chunk=chunks.append)[0]
    return chunks, done


def test_a_matched_stop_token_is_trimmed_from_the_text(raw_client: RawClient, hf_tok: Any) -> None:
    _, free = run(raw_client, max_tokens=16)
    ref = free.token_ids
    # A token first generated at index >= 2 whose own text is plain (not a piece of a
    # character, not blank): its text visibly leaves the output.
    at = next(i for i, t in enumerate(ref) if i >= 2 and t not in ref[:i]
              and hf_tok.decode([t]).strip() and "\ufffd" not in hf_tok.decode([t]))
    stop = ref[at]
    _, with_it = run(raw_client, max_tokens=at + 1)
    _, before_it = run(raw_client, max_tokens=at)
    for stream in (False, True):
        chunks, done = run(raw_client, max_tokens=16, stop_token_ids=[stop], stream=stream)
        assert (done.finish_reason, done.matched_stop) == ("stop", stop)
        assert done.token_ids == ref[: at + 1]  # the stop token stays in the ids
        assert done.text == before_it.text != with_it.text
        if stream:
            assert "".join(c.text for c in chunks) == done.text
            assert [t for c in chunks for t in c.token_ids] == done.token_ids


def test_logprob_texts_are_each_tokens_own_text(raw_client: RawClient, hf_tok: Any) -> None:
    chunks, done = run(raw_client, max_tokens=6, logprobs=True, top_logprobs=2, stream=True,
                       logprob_texts=True, prompt_logprobs_start=5)
    assert chunks
    for c in chunks:
        assert c.token_texts is not None
        ids = {*c.token_ids, *(alt.token_id for row in c.top_logprobs or () for alt in row)}
        assert set(c.token_texts) == ids
        assert all(text == hf_tok.decode([t]) for t, text in c.token_texts.items())
    assert done.prompt_token_ids == PROMPT[5:]
    assert done.token_texts is not None
    wanted = {*done.token_ids, *done.prompt_token_ids,
              *(alt.token_id for row in done.top_logprobs or () for alt in row),
              *(alt.token_id for row in done.prompt_top_logprobs or () for alt in row)}
    assert set(done.token_texts) == wanted
    assert all(text == hf_tok.decode([t]) for t, text in done.token_texts.items())
    _, plain = run(raw_client, max_tokens=3, logprobs=True)
    assert plain.token_texts is None and plain.prompt_token_ids is None
    _, from_zero = run(raw_client, max_tokens=1, prompt_logprobs_start=0)
    assert from_zero.prompt_token_ids == PROMPT[1:]  # the first token has no logprob


def test_logprob_start_len_reaches_back_into_the_programs_history(server: Any, hf: Any,
                                                                   hf_tok: Any) -> None:
    @rl.function
    def scored(s, start):
        s += "First part. "
        s += rl.gen("warm", max_tokens=3, ignore_eos=True, return_logprob=True)
        s += " Second."
        s += rl.gen("a", max_tokens=2, ignore_eos=True, return_logprob=True,
                    logprob_start_len=start, return_text_in_logprobs=True)

    with rl.connect(server.endpoint) as client:
        for start in (0, 4):
            state = scored.run(start=start, backend=client, temperature=0)
            meta = state.get_meta_info("a")
            triples = meta["input_token_logprobs"]
            assert len(triples) == meta["prompt_tokens"] - start
            # SGLang's first entry has no logprob (its logits predict the next token).
            assert triples[0][0] is None
            warm = [t[1] for t in state.get_meta_info("warm")["output_token_logprobs"]]
            whole = (hf_tok.encode("First part. ") + warm
                     + hf_tok.encode(" Second.", add_special_tokens=False))
            assert len(whole) == meta["prompt_tokens"]
            assert [t[1] for t in triples[1:]] == whole[start + 1:]
            assert [t[2] for t in triples[1:]] == [hf_tok.decode([t]) for t in whole[start + 1:]]
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
            expected = [lp[i - 1, whole[i]].item() for i in range(start + 1, len(whole))]
            np.testing.assert_allclose([t[0] for t in triples[1:]], expected, atol=2e-4)
