"""The GGUF tokenizer rebuilt with ``tokenizers`` alone, checked against transformers' own conversion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stride.model.files import default_model_path
from stride.model.gguf import read_gguf_metadata
from stride.tokenizer.loader import ModelTokenizer, load_tokenizer

TRICKY = [
    "Hello, world!",
    "The capital of France is Paris.",
    "日本語のテキスト、中文字符。한국어",
    "emoji 🤖👍🏽🇫🇷 family 👨‍👩‍👧‍👦 ❤️",
    "   \n\n\t  \r\n ",
    "tab\tand  double  spaces   end   ",
    "don't it's we'll I'M they'RE",
    "Ünïcödé ñ ß ﬁ naïve café \u200b zero width",
    "مرحبا بالعالم Привет, мир!",
    "x = [1,2,3]\n\tdef f(a, b):\n        return a+b  # ok\n",
    'fn main() { println!("{}", 42); }',
    "3.14159 a1b2c3 1234567890 1,000,000 2024-11-30",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a" * 60 + " " + "bc" * 20,
]
# Whitespace runs before digits: the GGUF says pre-tokenizer "smollm" (llama.cpp: split every digit off
# first, as the model's original tokenizer.json does); transformers' GGUF conversion ignores that and
# keeps GPT-2's split, so a run of spaces before a digit comes out as single spaces there.
DIVERGENT = {"  12  345 6789": (["ĠĠ", "1", "2", "ĠĠ", "3", "4", "5", "Ġ", "6", "7", "8", "9"],
                                ["Ġ", "Ġ", "1", "2", "Ġ", "Ġ", "3", "4", "5", "Ġ", "6", "7", "8", "9"])}


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def tok(gguf_path) -> ModelTokenizer:
    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def test_metadata_of_default_model(tok, gguf_path):
    assert tok.vocab_size == 49152
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (2,)
    assert not tok.add_bos_token and tok.chat_template and "<|im_start|>" in tok.chat_template
    meta = read_gguf_metadata(gguf_path)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30


@pytest.mark.parametrize("text", TRICKY)
def test_ids_equal_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_tricky_strings_really_are_tricky(tok):
    # Controls: these strings exercise merges, multi-token characters and special tokens.
    assert len(tok.encode("🤖")) > 1
    assert tok.encode("<|im_start|>user")[0] == 1
    assert len(tok.encode("a" * 60)) < 60
    assert tok.encode("hello") != tok.encode(" hello")


def test_known_divergence_from_transformers_is_only_digit_splitting(tok, hf_tok):
    for text, (ours, theirs) in DIVERGENT.items():
        assert [tok.tokenizer.id_to_token(i) for i in tok.encode(text)] == ours
        assert [tok.tokenizer.id_to_token(i) for i in hf_tok.encode(text, add_special_tokens=False)] == theirs
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_skipped_on_decode(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\nHi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


def test_hf_directory(tok, tmp_path):
    tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
              "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = load_tokenizer(tmp_path)
    assert hf.eos_token_ids == (2, 0) and hf.chat_template == "{{ messages[0]['content'] }}"
    assert hf.encode("hi there") == [1, *tok.encode("hi there")]
    assert hf.encode("hi there", add_special_tokens=False) == tok.encode("hi there")


def test_not_a_model(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"nope")
    with pytest.raises(ValueError):
        load_tokenizer(tmp_path / "x.bin")
    (tmp_path / "x.gguf").write_bytes(b"nope" * 8)
    with pytest.raises(ValueError):
        load_tokenizer(tmp_path / "x.gguf")
