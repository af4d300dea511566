"""Build the model's tokenizer (HF ``tokenizers``) from a GGUF file or an HF checkpoint directory.

The runtime does not need ``transformers``: a GGUF byte-level BPE vocabulary is rebuilt from
``tokenizer.ggml.tokens`` / ``merges`` / ``token_type`` with ``tokenizers`` directly, and the pre-tokenizer
is chosen by ``tokenizer.ggml.pre`` the way llama.cpp does. Metadata comes from :mod:`stride.model.gguf`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from stride.model.gguf import read_gguf_metadata

# GGUF token types (llama.cpp): 1 normal, 3 control, 4 user-defined, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split digits one by one first, the word-splitting regex).
_PRE_SPLITS: dict[str, tuple[bool, str]] = {
    "default": (False, _GPT2_SPLIT), "gpt-2": (False, _GPT2_SPLIT), "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT), "starcoder": (True, _GPT2_SPLIT), "refact": (True, _GPT2_SPLIT),
    "codeshell": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT), "llama-bpe": (False, _LLAMA3_SPLIT), "llama-v3": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT), "dbrx": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest move to U+0100 onwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(0x100 + extra)
            extra += 1
    return mapping


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer and the metadata around it that serving needs."""

    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    """Ids that end generation (the model's end-of-sequence token, and any extras its config lists)."""
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    """Whether ``encode(..., add_special_tokens=True)`` prepends BOS (set up as the post-processor)."""
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tokenizer.token_to_id(self.bos_token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text in it (``<|im_start|>``) maps to the special id.
        Rendered chat templates already hold their BOS: encode them with ``add_special_tokens=False``."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model: str | Path) -> ModelTokenizer:
    """The tokenizer of a GGUF file or an HF checkpoint directory."""
    path = Path(model)
    if path.is_dir():
        return tokenizer_from_hf_dir(path)
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(path)
    raise ValueError(f"{path}: expected a GGUF file or an HF checkpoint directory")


# ---------------------------------------------------------------- GGUF


def tokenizer_from_gguf(path: str | Path) -> ModelTokenizer:
    meta = read_gguf_metadata(path, prefix="tokenizer.")
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_SPLITS)}")
    alphabet = byte_to_unicode()
    letters = set(alphabet.values())
    # A normal token spelled outside the byte alphabet is raw text; spell it the byte-level way.
    vocab = {}
    for index, (token, kind_id) in enumerate(zip(tokens, token_types, strict=True)):
        if kind_id not in (_CONTROL, _USER_DEFINED) and not set(token) <= letters:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{path}: malformed merges")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split_digits, regex = _PRE_SPLITS[pre]
    steps: list[pre_tokenizers.PreTokenizer] = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, token_types, strict=True) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, k in zip(tokens, token_types, strict=True) if k == _USER_DEFINED])

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and token_at("bos_token_id") is not None:
        _prepend_bos(tokenizer, tokens[meta["tokenizer.ggml.bos_token_id"]])
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eot_id = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos_id, eot_id) if i is not None))
    return ModelTokenizer(tokenizer, eos_ids, bos_token=token_at("bos_token_id"),
                          eos_token=token_at("eos_token_id"),
                          add_bos_token=add_bos,
                          chat_template=meta.get("tokenizer.chat_template"))


# ---------------------------------------------------------------- HF checkpoint directory


def tokenizer_from_hf_dir(path: str | Path) -> ModelTokenizer:
    """``tokenizer.json`` plus ``tokenizer_config.json`` (chat template, bos/eos, add_bos_token); eos ids
    also from ``generation_config.json`` / ``config.json`` where they list several."""
    root = Path(path)
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    config = _read_json(root / "tokenizer_config.json")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    eos_ids: list[int] = []
    eos_id = None if eos is None else tokenizer.token_to_id(eos)
    if eos_id is not None:
        eos_ids.append(eos_id)
    for name in ("generation_config.json", "config.json"):
        listed = _read_json(root / name).get("eos_token_id")
        eos_ids += listed if isinstance(listed, list) else [listed] if isinstance(listed, int) else []
    add_bos = bool(config.get("add_bos_token", False)) and bos is not None
    bos_id = None if bos is None else tokenizer.token_to_id(bos)
    if add_bos and bos is not None and tokenizer.encode("", add_special_tokens=True).ids[:1] != [bos_id]:
        _prepend_bos(tokenizer, bos)  # the config asks for BOS but tokenizer.json's post-processor lacks it
    return ModelTokenizer(tokenizer, tuple(dict.fromkeys(eos_ids)), bos_token=bos, eos_token=eos,
                          add_bos_token=add_bos, chat_template=template)


def _prepend_bos(tokenizer: Tokenizer, bos: str) -> None:
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
