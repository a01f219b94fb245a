"""`Tokenizer`: a model directory's tokenizer, chat templates and end-of-sequence ids.

Built on the `tokenizers` library (a Rust extension that imports in milliseconds) rather
than on `transformers`, because it runs in the engine's frontend process. It reads the
files that `transformers` writes with `save_pretrained` and that hub checkpoints ship:

- ``tokenizer.json`` (required): the fast tokenizer, added tokens included;
- ``tokenizer_config.json``: bos/eos/unk/pad tokens, extra ``added_tokens_decoder``
  entries and, in older checkpoints, ``chat_template`` (a string or a list of
  ``{"name", "template"}``);
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (the newer layout; they
  take priority over the config's entry, as in `transformers`), or ``chat_template.json``;
- ``generation_config.json`` (or, without it, ``config.json``): ``eos_token_id`` (an int
  or a list), merged into `eos_token_ids`.

Decoding is the `tokenizers` decode as-is: ``clean_up_tokenization_spaces`` is ignored (it
is off for every model family radixlm serves, transformers skips it for BPE anyway, and it
would break incremental detokenization's "deltas concatenate to the full decode").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from radixlm.tokenizer.chat_template import ChatTemplate
from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Above this many characters `encode` releases the GIL (the batch call's small extra cost
# is then negligible next to the encoding itself).
GIL_FREE_ENCODE_CHARS = 4096


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A loaded tokenizer. Build it with `Tokenizer.load(model_dir)`.

    Attributes: `eos_token_ids` (frozenset, tokenizer eos + generation config eos),
    `bos_token_id` (or None), `chat_template` (the default `ChatTemplate` or None),
    `chat_templates` (all named templates), `special_tokens` (``{"bos_token": "<s>", ...}``
    as the template sees them), `all_special_ids`, `vocab_size` (added tokens included;
    the model's logits may be wider, padded).
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._tok = backend
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        eos_ids = set(eos_token_ids)
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.all_special_ids: frozenset[int] = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # token_text's memo, per skip_special_tokens value: at most vocab_size entries each.
        self._token_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        extra = {
            k: v for k, v in self.special_tokens.items() if k not in ("bos_token", "eos_token")
        }
        self.chat_templates: dict[str, ChatTemplate] = {
            name: ChatTemplate(
                source,
                bos_token=self.special_tokens.get("bos_token"),
                eos_token=self.special_tokens.get("eos_token"),
                extra_context=extra,
            )
            for name, source in (chat_templates or {}).items()
        }
        self.chat_template: ChatTemplate | None = self.chat_templates.get("default")

    # -- loading ----------------------------------------------------------------------

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        """Load from an HF-style directory (see the module docstring for the files read)."""
        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{root} has no tokenizer.json: radixlm needs a fast tokenizer file "
                "(convert a slow/sentencepiece tokenizer with transformers' save_pretrained)"
            )
        backend = _HFTokenizer.from_file(str(tok_file))
        config = _read_json(root / "tokenizer_config.json")

        # Added tokens the config lists but tokenizer.json lacks (rare; transformers adds them too).
        decoder = config.get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            for tid, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
                content = _token_content(entry)
                if content is None or backend.token_to_id(content) is not None:
                    continue
                special = bool(entry.get("special", False)) if isinstance(entry, Mapping) else False
                added = AddedToken(content, special=special, normalized=not special)
                if special:
                    backend.add_special_tokens([added])
                else:
                    backend.add_tokens([added])
                if backend.token_to_id(content) != int(tid):
                    raise ValueError(
                        f"{root}: added token {content!r} should have id {tid} but got "
                        f"{backend.token_to_id(content)}"
                    )

        special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                special_tokens[key] = content

        gen_config = _read_json(root / "generation_config.json")
        if "eos_token_id" in gen_config:
            eos_ids = _as_id_list(gen_config["eos_token_id"])
        else:
            eos_ids = _as_id_list(_read_json(root / "config.json").get("eos_token_id"))

        return cls(
            backend,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            chat_templates=_load_chat_templates(root, config),
        )

    # -- encode / decode --------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (``<|im_start|>``) are
        recognised; `add_special_tokens` applies the tokenizer's post-processor (a BOS for
        Llama-style tokenizers).

        Texts longer than `GIL_FREE_ENCODE_CHARS` go through `tokenizers`' batch call, which
        releases the GIL while it runs (its single-text ``encode`` holds it: 0.3-0.5 s on
        100k characters), so other threads keep running."""
        if len(text) > GIL_FREE_ENCODE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text; releases the GIL while `tokenizers` works."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (special tokens kept unless `skip_special_tokens`)."""
        if not isinstance(ids, list):
            ids = [int(i) for i in ids]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """``decode([token_id])``, memoised: the incremental detokenizer asks for it once
        per streamed token. (Safe from several threads: a race only decodes twice.)"""
        memo = self._token_texts[bool(skip_special_tokens)]
        text = memo.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=skip_special_tokens)
            if 0 <= token_id < self.vocab_size:
                memo[token_id] = text
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
            f"eos_token_ids={sorted(self.eos_token_ids)}, "
            f"chat_templates={sorted(self.chat_templates)})"
        )


def _load_chat_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named template sources; the default one is named ``"default"`` (transformers' order)."""
    templates: dict[str, str] = {}
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates

    source: Any = config.get("chat_template")
    if source is None:
        source = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(source, str):
        templates["default"] = source
    elif isinstance(source, list):
        for entry in source:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
    elif isinstance(source, Mapping):
        templates.update({str(k): v for k, v in source.items() if isinstance(v, str)})
    return templates
