"""GGUF SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`: Gemma, Phi-3) rebuilt
as a `tokenizers.Tokenizer` (runtime/model/gguf_spm.py) tokenize as SentencePiece itself
does: a small BPE model is trained here with the `sentencepiece` library, written into GGUF
metadata the way llama.cpp's converter writes one (pieces, scores, token types; Gemma's
whitespace-only pieces as real spaces), and both encode the same texts to the same ids.
Special tokens split the text first, and each piece of text after one starts a new
SentencePiece input (with its own space prefix where the vocabulary adds one), as
llama.cpp and transformers' fast Llama tokenizers do; SentencePiece alone would see one
stream. Where llama.cpp's own vocabulary test for Phi-3 is on this machine (the vendored llama.cpp
sources the benchmarks build), its expected ids are checked too.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from radixlm.runtime.model.gguf_convert import build_tokenizer, tokenizer_config_from_gguf

spm = pytest.importorskip("sentencepiece")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. A radix tree keeps every prompt prefix.",
    "Hello world! How are you today?   I am fine, thank you.\nWhat is the weather like?",
    "def main():\n    print('hello')\n    return 0\n\n",
    "ünïcode 🤖 two  spaces, 1234567890 + 42 = 1234567932.",
]
TEXTS = [
    "Hello world", " Hello  world!", "   leading spaces", "trailing  ", "line\nbreaks\n\n\ttab",
    "1234567890", "unseen 漢字 and 🦙 bytes", "<start_of_turn>user\nHi<end_of_turn>\n", "",
    "def main():\n    return 'x'", "ünïcode", "a" * 40,
]  # fmt: skip
SPECIALS = ("<start_of_turn>", "<end_of_turn>")
# SentencePiece piece kinds -> GGUF token types (llama.cpp's converter).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def _train(add_dummy_prefix: bool):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=model, vocab_size=420,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, user_defined_symbols=list(SPECIALS),
        normalization_rule_name="identity", minloglevel=2,  # as Llama and Gemma
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _gguf_meta(sp, arch: str, add_space_prefix: bool) -> dict:
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece = sp.id_to_piece(i)
        kind = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i)
                else BYTE if sp.is_byte(i) else NORMAL)  # fmt: skip
        if piece in SPECIALS:
            kind = USER_DEFINED
        if arch.startswith("gemma") and piece and not piece.strip("\u2581"):
            piece = piece.replace("\u2581", " ")  # Gemma's files spell these with spaces
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(kind)
    return {
        "general.architecture": arch,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
        "phi3.context_length": 256,
        "gemma3.context_length": 256,
    }


def _expected(sp, text: str) -> list[int]:
    """SentencePiece's ids of each piece of `text` between special tokens."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        ids += [sp.piece_to_id(part)] if part in SPECIALS else (sp.encode(part) if part else [])
    return ids


@pytest.mark.parametrize(("arch", "prefix"), [("phi3", True), ("gemma3", False)])
def test_sentencepiece_vocabulary_tokenizes_as_sentencepiece(arch, prefix):
    sp = _train(add_dummy_prefix=prefix)
    meta = _gguf_meta(sp, arch, prefix)
    tok = build_tokenizer(meta)
    for text in TEXTS:
        want = _expected(sp, text)
        assert tok.encode(text, add_special_tokens=False).ids == want, text
        if not any(special in text for special in SPECIALS):
            assert tok.decode(want) == sp.decode(want) == text, text
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    assert tok.encode("Hi").ids[0] == sp.bos_id()
    assert tokenizer_config_from_gguf(meta)["add_bos_token"] is True
    meta["tokenizer.ggml.add_bos_token"] = False
    assert build_tokenizer(meta).encode("Hi").ids == sp.encode("Hi")


LLAMA_CPP_VOCABS = (Path.home() / ".cache/radixlm/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/models")


@pytest.mark.skipif(not (LLAMA_CPP_VOCABS / "ggml-vocab-phi-3.gguf").is_file(),
                    reason="llama.cpp's vendored vocabulary tests are not on this machine")  # fmt: skip
def test_phi3_vocabulary_matches_llama_cpps_own_expected_ids():
    from radixlm.runtime.model.gguf_file import GGUFFile

    path = LLAMA_CPP_VOCABS / "ggml-vocab-phi-3.gguf"
    tok = build_tokenizer(GGUFFile(path).metadata())
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) >= 40
    for text, ids in zip(texts, expected, strict=False):
        assert tok.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()], text
