"""radixlm.runtime.engine.sampling against independent references (numpy, transformers)."""

from __future__ import annotations

import dataclasses
import math
import random
import zlib
from collections import Counter

import numpy as np
import pytest
import torch
from radixlm.runtime.engine import sampling
from radixlm.runtime.engine.sampling import (
    Sampler,
    make_generator,
    prompt_logprobs,
    validate_sampling,
)


@dataclasses.dataclass
class P:
    """Mirrors radixlm.runtime.protocol.SamplingParams (the sampler reads attributes only)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list = dataclasses.field(default_factory=list)
    stop_token_ids: list = dataclasses.field(default_factory=list)
    stop_regex: list = dataclasses.field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def short(p: P) -> str:
    """Test id: the fields that differ from the defaults."""
    default = P()
    return (
        ",".join(
            f"{f.name}={getattr(p, f.name)!r}"
            for f in dataclasses.fields(p)
            if getattr(p, f.name) != getattr(default, f.name)
        )
        or "defaults"
    )


def rand_logits(b: int, v: int, seed: int, scale: float = 3.0, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * scale).to(device)


# The sampler's own tests run on CPU; with CUDA present (the device check) they also run
# on the GPU, with generators and logits there.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


# -- greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_argmax(device):
    logits = rand_logits(8, 100, 0, device=device)
    s = Sampler(100, device)
    out = s.sample(logits, [P(temperature=0)] * 8, [[]] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    # Greedy rows stay argmax in a batch with sampled rows.
    params = [P(temperature=0) if i % 2 else P(temperature=1.5, top_k=5) for i in range(8)]
    out = s.sample(logits, params, [[]] * 8)
    for i in range(1, 8, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_greedy_ties_take_the_first_maximum_and_nan_wins():
    """The CPU argmax (numpy's) agrees with a plain-Python first-maximum scan: ties go to
    the lowest id, a NaN row picks its first NaN (as torch does), padded views work."""
    wide = torch.zeros(4, 130)
    wide[0, [7, 90]] = 5.0  # a tie
    wide[1, 3], wide[1, 50] = 1.0, float("nan")
    wide[2] = -1.0  # all equal
    wide[3, 129] = float("inf")
    logits = wide[:, :128]  # a non-contiguous view: the two last columns are padding

    def first_max(row: list[float]) -> int:
        nans = [i for i, v in enumerate(row) if math.isnan(v)]
        return nans[0] if nans else row.index(max(row))

    out = Sampler(128, "cpu").sample(logits, [P(temperature=0)] * 4, [[]] * 4)
    assert out.token_ids == [first_max(r) for r in logits.tolist()] == [7, 50, 0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_padded_vocab_columns_are_never_chosen(device):
    logits = rand_logits(4, 40, 1, device=device)
    logits[:, 32:] = 100.0  # embedding padding past the tokenizer's vocabulary
    s = Sampler(32, device)
    assert all(t < 32 for t in s.sample(logits, [P(temperature=0)] * 4, [[]] * 4).token_ids)
    many = logits[:1].repeat(500, 1)
    assert all(t < 32 for t in s.sample(many, [P()] * 500, [[]] * 500).token_ids)


# -- seeded reproducibility --------------------------------------------------------------

REQUESTS = {
    "a": P(seed=1, temperature=0.9),
    "b": P(seed=2, top_k=8, top_p=0.9),
    "c": P(seed=3, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
    "d": P(seed=1, temperature=1.3, top_p=0.8),  # same seed as "a", other params
    "e": P(temperature=1.0),  # unseeded
    "f": P(temperature=0),  # greedy
}


def _run(
    names: list[str], steps: int, vocab: int = 50, device: str = "cpu"
) -> dict[str, list[int]]:
    """Decode `steps` tokens for `names` batched together; logits depend on (request, step) only."""
    s = Sampler(vocab, device)
    gens = {n: make_generator(REQUESTS[n].seed, device) for n in names}
    outs: dict[str, list[int]] = {n: [] for n in names}
    prompts = {n: [ord(n) % vocab, 3, 4] for n in names}
    for step in range(steps):
        logits = torch.stack([rand_logits(1, vocab, ord(n) * 1000 + step)[0] for n in names])
        logits = logits.to(device)
        res = s.sample(
            logits,
            [REQUESTS[n] for n in names],
            [outs[n] for n in names],
            [prompts[n] for n in names],
            [gens[n] for n in names],
        )
        for n, t in zip(names, res.token_ids, strict=True):
            outs[n].append(t)
    return outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", ["small", "large"])
def test_seeded_requests_reproduce_regardless_of_batch(device, size):
    # "large": past the top-p candidate window; SmolLM2's real vocabulary on the GPU.
    vocab = 50 if size == "small" else 49152 if device == "cuda" else 4096
    steps = 25 if size == "small" else 6
    seeded = ["a", "b", "c", "d"]
    solo = {n: _run([n], steps, vocab, device)[n] for n in seeded}
    rng = random.Random(0)
    for _ in range(3):
        names = [*seeded, "e", "f"]
        rng.shuffle(names)
        together = _run(names, steps, vocab, device)
        for n in seeded:
            assert together[n] == solo[n], n
    subset = _run(["c", "a"], steps, vocab, device)
    assert subset["a"] == solo["a"] and subset["c"] == solo["c"]
    assert solo["a"] != solo["d"]  # same seed, different distribution


def test_different_seeds_differ_and_same_seed_repeats():
    logits = rand_logits(1, 1000, 5, scale=0.1)  # nearly uniform: collisions are unlikely
    s = Sampler(1000)

    def draws(seed):
        g = make_generator(seed, "cpu")
        return [s.sample(logits, [P(seed=seed)], [[]], None, [g]).token_ids[0] for _ in range(10)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert make_generator(None, "cpu") is None
    assert draws(-1) == draws(-1)  # negative seeds are accepted


# -- top-k / top-p / min-p ------------------------------------------------------------------


def allowed_set(logits: np.ndarray, p: P) -> tuple[np.ndarray, np.ndarray] | None:
    """Independent float64 computation of the tokens a row may sample and their
    probabilities; None if a threshold falls too close to call."""
    z = logits.astype(np.float64) / p.temperature
    v = z.shape[0]
    keep = np.ones(v, dtype=bool)
    if 0 < p.top_k < v:
        kth = np.sort(z)[::-1][p.top_k - 1]
        keep &= z >= kth

    def softmax(mask):
        w = np.where(mask, np.exp(z - z[mask].max()), 0.0)
        return w / w.sum()

    if p.top_p < 1.0:
        probs = softmax(keep)
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        if np.any(np.abs(before - p.top_p) < 1e-4):
            return None
        keep_sorted = before < p.top_p
        keep_p = np.zeros(v, dtype=bool)
        keep_p[order[keep_sorted]] = True
        keep &= keep_p
    if p.min_p > 0:
        probs = softmax(keep)
        threshold = p.min_p * probs.max()
        if np.any(np.abs(probs[keep] - threshold) < 1e-6):
            return None
        keep &= probs >= threshold
    return keep, softmax(keep)


FILTER_CASES = [
    P(top_k=1),
    P(top_k=5),
    P(top_k=20, temperature=0.7),
    P(top_p=0.5),
    P(top_p=0.9, temperature=1.5),
    P(min_p=0.1),
    P(min_p=0.02, temperature=2.0),
    P(top_k=10, top_p=0.7),
    P(top_k=12, top_p=0.95, min_p=0.05, temperature=0.8),
    P(top_p=0.3, min_p=0.2),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", FILTER_CASES, ids=short)
def test_filters_never_sample_outside_the_allowed_set(params, device):
    vocab, draws = 64, 4000
    rng = np.random.default_rng(zlib.crc32(repr(params).encode()))
    for _ in range(3):
        row = rng.normal(size=vocab).astype(np.float32) * 2.5
        ref = allowed_set(row, params)
        if ref is not None:
            break
    assert ref is not None
    keep, probs = ref
    s = Sampler(vocab, device)
    warped = s.warp(torch.from_numpy(row)[None].to(device), [params])[0]
    assert np.array_equal(torch.isfinite(warped).cpu().numpy(), keep)

    logits = torch.from_numpy(row)[None].repeat(draws, 1).to(device)
    tokens = np.array(s.sample(logits, [params] * draws, [[]] * draws).token_ids)
    assert keep[tokens].all(), "sampled a token outside the allowed set"
    freq = np.bincount(tokens, minlength=vocab) / draws
    assert np.abs(freq - probs).max() < 0.035  # and in the right proportions


@pytest.mark.parametrize("candidates", [1, 4, 16])
def test_top_p_candidate_window_and_fallback_agree_with_reference(monkeypatch, candidates):
    """Top-p first sorts only the top `candidates` logits; rows whose candidates hold less
    than p fall back to a full sort. Both paths give the reference's allowed set."""
    monkeypatch.setattr(sampling, "_TOP_P_CANDIDATES", candidates)
    vocab = 64
    rng = np.random.default_rng(candidates)
    rows, params = [], []
    for p in FILTER_CASES:
        for scale in (0.3, 6.0):  # flat (needs many tokens) and peaked (needs few)
            row = rng.normal(size=vocab).astype(np.float32) * scale
            if allowed_set(row, p) is not None:
                rows.append(row)
                params.append(p)
    warped = Sampler(vocab).warp(torch.from_numpy(np.stack(rows)), params)
    for i, (row, p) in enumerate(zip(rows, params, strict=True)):
        keep, _ = allowed_set(row, p)
        assert np.array_equal(torch.isfinite(warped[i]).numpy(), keep), short(p)


def test_top_p_one_keeps_the_whole_tail():
    row = torch.linspace(0, -60, 2000)[None].repeat(3, 1)  # a long tail of ~0 probabilities
    params = [P(top_p=1.0), P(top_p=0.5), P(top_p=1.0, top_k=1999)]
    kept = torch.isfinite(Sampler(2000).warp(row, params)).sum(dim=-1).tolist()
    assert kept[0] == 2000 and kept[2] == 1999 and kept[1] < 100


def test_top_k_keeps_ties_at_the_boundary():
    row = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    warped = Sampler(5).warp(row, [P(top_k=2)])
    assert torch.isfinite(warped[0]).tolist() == [True, True, True, False, False]


# -- penalties -----------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab = 30
    logits = rand_logits(3, vocab, 11)
    prompts = [[1, 2, 3, 3], [5], [7, 8]]
    outputs = [[4, 4, 9], [5, 6], []]
    penalties = [1.3, 0.7, 2.0]
    params = [P(repetition_penalty=r) for r in penalties]
    got = Sampler(vocab).apply_penalties(logits, params, outputs, prompts)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], expected)


def test_frequency_and_presence_penalties_match_the_formula():
    vocab = 25
    logits = rand_logits(3, vocab, 12)
    outputs = [[1, 1, 1, 2, 7], [], [3, 3, 24]]
    prompts = [[1, 9], [9], [0]]  # prompt tokens do not count for these two
    params = [
        P(frequency_penalty=0.5, presence_penalty=0.25),
        P(frequency_penalty=-1.0),
        P(frequency_penalty=0.2, presence_penalty=-0.6, repetition_penalty=1.5),
    ]
    got = Sampler(vocab).apply_penalties(logits, params, outputs, prompts)
    for i, p in enumerate(params):
        expected = logits[i].tolist()
        seen = set(prompts[i]) | set(outputs[i])
        for t in seen:  # repetition first (HF rule), over prompt + output
            x = expected[t]
            expected[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t, c in Counter(outputs[i]).items():
            expected[t] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(got[i], torch.tensor(expected))


def test_rows_without_penalties_are_untouched_and_prompt_is_optional():
    logits = rand_logits(2, 10, 13)
    s = Sampler(10)
    assert s.apply_penalties(logits, [P(), P()], [[1], [2]]) is logits
    got = s.apply_penalties(logits, [P(), P(repetition_penalty=2.0)], [[1], [2]], None)
    torch.testing.assert_close(got[0], logits[0])
    changed = (got[1] != logits[1]).nonzero().flatten().tolist()
    assert changed == ([2] if logits[1, 2] != 0 else [])


def test_greedy_sees_penalties():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    out = Sampler(3).sample(logits, [P(temperature=0, presence_penalty=1.0)], [[0]])
    assert out.token_ids == [1]


# -- logprobs --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_sample_logprobs_are_raw_model_logprobs(device):
    vocab = 40
    logits = rand_logits(4, vocab, 14, device=device)
    params = [
        P(logprobs=True, top_logprobs=3, temperature=0.5, repetition_penalty=1.5),
        P(temperature=0, logprobs=True),
        P(),  # asks nothing: still gets an entry, no alternatives
        P(top_logprobs=5, top_k=3, frequency_penalty=1.0),
    ]
    out = Sampler(vocab, device).sample(
        logits,
        params,
        [[1, 2], [], [3], [4, 4]],
        [[5]] * 4,
        [make_generator(i, device) for i in range(4)],
    )
    raw = torch.log_softmax(logits.double(), -1).cpu()
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(float(raw[i, t]), abs=1e-5)
        n = params[i].top_logprobs
        assert len(out.top_logprobs[i]) == n
        vals, idx = raw[i].topk(n) if n else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in out.top_logprobs[i]] == idx.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_banned_tokens_are_never_sampled_and_leave_the_logprobs_renormalised(device):
    """min_tokens: a row's banned tokens (its EOS and stop ids) get probability 0; the
    logprobs are those of the distribution without them; a row whose only allowed tokens
    are banned (a grammar at its end) keeps them."""
    vocab = 30
    logits = rand_logits(3, vocab, 21, device=device)
    top = logits.argmax(-1).tolist()
    banned = [[top[0], 3], [], list(range(vocab))]
    params = [P(temperature=0, logprobs=True), P(temperature=0, logprobs=True),
              P(temperature=0, logprobs=True)]
    out = Sampler(vocab, device).sample(logits.clone(), params, [[]] * 3, banned=banned)
    reference = logits.double().cpu().clone()
    reference[0, banned[0]] = -math.inf
    assert out.token_ids == [int(reference[0].argmax()), top[1], top[2]]
    raw = torch.log_softmax(reference, -1)
    assert out.logprobs[0] == pytest.approx(float(raw[0, out.token_ids[0]]), abs=1e-5)
    for seed in range(20):  # sampled rows too
        picked = Sampler(vocab, device).sample(
            rand_logits(1, vocab, seed, device=device), [P()], [[]],
            banned=[banned[0]]).token_ids[0]
        assert picked not in banned[0]


def test_prompt_logprobs_equal_log_softmax(monkeypatch):
    monkeypatch.setattr(sampling, "_PROMPT_LOGPROB_CHUNK", 3)  # exercise chunking
    logits = rand_logits(10, 20, 15)
    logits[:, 16:] = 50.0  # padding columns, dropped with vocab_size
    targets = [i % 16 for i in range(10)]
    res = prompt_logprobs(logits, targets, top_n=2, vocab_size=16)
    ref = torch.log_softmax(logits[:, :16].double(), -1)
    assert res.logprobs == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(targets)], abs=1e-5
    )
    for i in range(10):
        vals, idx = ref[i].topk(2)
        assert [t for t, _ in res.top_logprobs[i]] == idx.tolist()
    assert prompt_logprobs(logits, torch.tensor(targets)).top_logprobs is None
    with pytest.raises(ValueError, match="targets"):
        prompt_logprobs(logits, targets[:-1])


def test_prompt_logprobs_of_a_tiny_llama_match_its_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    logits = out.logits[0].float()
    res = prompt_logprobs(logits[:-1], ids[0, 1:], top_n=1)
    expected = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    assert res.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    # transformers' loss is the mean negative log-likelihood of the same targets.
    assert -sum(res.logprobs) / len(res.logprobs) == pytest.approx(float(out.loss), abs=1e-5)
    assert [t for ((t, _),) in res.top_logprobs] == logits[:-1].argmax(-1).tolist()


# -- validation ------------------------------------------------------------------------------

BAD = [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("max_tokens", -1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0),
    ("presence_penalty", -math.inf),
    ("top_logprobs", -1),
    ("top_logprobs", 21),
    ("seed", 1 << 64),
    ("seed", 1.5),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("min_tokens", -1),
    ("min_tokens", 129),  # more than max_tokens
    ("min_tokens", 1.5),
    ("stop_regex", ["("]),
    ("stop_regex", ["(a+)+"]),  # exponential backtracking
    ("stop_regex", [""]),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_validation_catches_each_bad_value(field, value):
    message = validate_sampling(P(**{field: value}))
    assert message is not None and field in message


GOOD = [
    P(),
    P(temperature=0),
    P(max_tokens=0),
    P(top_k=0),
    P(top_k=-1),
    P(top_k=1),
    P(top_p=1.0),
    P(min_p=1.0),
    P(frequency_penalty=-2.0, presence_penalty=2.0),
    P(top_logprobs=20, logprobs=True),
    P(seed=0),
    P(seed=-5),
    P(seed=(1 << 64) - 1),
    P(repetition_penalty=0.5),
    P(stop=["\n"], stop_token_ids=[0, 5]),
    P(min_tokens=128, stop_regex=["[0-9]+\\.", "END"]),
]


@pytest.mark.parametrize("params", GOOD, ids=short)
def test_validation_accepts_valid_values(params):
    assert validate_sampling(params) is None


def test_validation_bounds_stop_token_ids_by_vocab():
    assert validate_sampling(P(stop_token_ids=[99]), vocab_size=100) is None
    assert "stop_token_ids" in validate_sampling(P(stop_token_ids=[100]), vocab_size=100)


def test_protocol_struct_works():
    protocol = pytest.importorskip("radixlm.runtime.protocol")
    sp = protocol.SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=True)
    assert validate_sampling(sp) is None
    assert validate_sampling(protocol.SamplingParams(top_p=0.0)) is not None
    out = Sampler(50).sample(rand_logits(1, 50, 3), [sp], [[]], None, [make_generator(3, "cpu")])
    assert len(out.token_ids) == 1 and out.logprobs is not None


def test_shape_errors():
    s = Sampler(10)
    with pytest.raises(ValueError, match="params"):
        s.sample(rand_logits(2, 10, 0), [P()], [[]])
    with pytest.raises(ValueError, match="batch"):
        s.sample(torch.zeros(10), [P()], [[]])
    assert s.sample(torch.zeros(0, 10), [], []).token_ids == []


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_frequencies_follow_the_distribution(device):
    """40,000 draws from one distribution (with zero-probability tokens, a heavy head and a
    long light tail): each token's count within 5 binomial standard deviations of its
    expectation, and the masked tokens never."""
    vocab, n = 64, 40_000
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(vocab, generator=g) * 2
    logits[[3, 17, 40]] = -math.inf  # as a grammar mask leaves them
    logits[5] = 6.0
    probs = torch.softmax(logits.double(), dim=-1)
    rows = logits.to(device).expand(n, vocab).contiguous()
    res = Sampler(vocab, device).sample(rows, [P(temperature=1.0)] * n, [[]] * n)
    counts = Counter(res.token_ids)
    assert not {3, 17, 40} & set(counts)
    for tok in range(vocab):
        p = float(probs[tok])
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts.get(tok, 0) - n * p) <= 5 * sd + 1, (tok, counts.get(tok, 0), n * p)
