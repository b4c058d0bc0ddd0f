"""GGUF tokenizers (`tokenizer.ggml.*`) equal transformers' own GGUF tokenizer on a varied sample: byte-level
BPE under each pre-tokenizer name, SentencePiece-style BPE (Gemma and Llama flavours); special tokens, BOS,
chat template, incremental detokenization."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from helpers import make_checkpoint
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from streamserve.errors import ChatTemplateError
from streamserve.models.gguf import gguf_tokenizer, open_gguf
from streamserve.models.gguf.writer import write_gguf
from streamserve.models.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we've 12345 reasons to test tokenizers!",
    "Le café naïve coûte 3,50 €; ünïcödé text, 日本語のテキスト, русский текст, emoji 🤖🎉 and tabs\tand\nnewlines.",
    "def f(x):\n    return x ** 2  # code with    runs of spaces\n\n",
    "Numbers: 1 22 333 4444 55555 3.14159 1e-9; user assistant system hello world what is the capital of France",
] * 20
TEXTS = [
    "Hello world 2024!  ",
    " The  café naïve 日本語 🤖\n\ttab",
    "a  b   c    d\n\n\nend",
    "1234567890 and 3.14",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<think>reasoning</think> ünïcödé ∑ 🤖🤖 Ωmega",
    "",
    " ",
]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
CONTROL, NORMAL, USER_DEFINED, BYTE = 3, 1, 4, 6


def byte_level_metadata(pre: str) -> dict[str, Any]:
    """A byte-level BPE trained on CORPUS, as llama.cpp writes a "gpt2" vocabulary."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<think>", "</think>"]
    merges = [" ".join(m) for m in _merges(tok)]
    types = [CONTROL if t in specials else USER_DEFINED if t in ("<think>", "</think>") else NORMAL for t in tokens]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "token_type": types, "merges": merges,
            "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0, "add_bos_token": False,
            "chat_template": TEMPLATE}


def _merges(tok: HFTokenizer) -> list[tuple[str, ...]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
            for m in json.loads(tok.to_str())["model"]["merges"]]


def sentencepiece_metadata(gemma: bool) -> dict[str, Any]:
    """A SentencePiece-style vocabulary (no merges in the file) as llama.cpp writes one: control tokens, the
    256 byte tokens, pieces in merge order; Gemma also stores a run of spaces as spaces."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    # Gemma's own control tokens, or Llama's (transformers' tokenizer classes add theirs when a vocabulary lacks them)
    control = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"] if gemma
               else ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"])
    extra = ["  ", "\n", "<think>", "</think>"] if gemma else ["<think>", "</think>"]
    tokens = control + [f"<0x{b:02X}>" for b in range(256)] + extra + [p for p in pieces if p not in extra]
    types = ([CONTROL] * len(control) + [BYTE] * 256 + [USER_DEFINED] * len(extra)
             + [NORMAL] * (len(tokens) - len(control) - 256 - len(extra)))
    fixed = len(control) + 256 + len(extra)
    ranks = [-float(i) for i in range(len(tokens) - fixed)]
    if gemma:  # Gemma's scores do not follow its merge order (its token order does): shuffle them
        random.Random(0).shuffle(ranks)
    scores = [-1000.0] * fixed + ranks
    ids = {"bos_token_id": 2, "eos_token_id": 1, "padding_token_id": 0, "unknown_token_id": 3} if gemma else {
        "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}
    return {"model": "llama", "pre": "default", "tokens": tokens, "token_type": types, "scores": scores, **ids,
            "add_bos_token": True, "add_eos_token": False}


def write(folder: Path, arch: str, meta: dict[str, Any]) -> Path:
    cfg: dict[str, Any] = dict(vocab_size=len(meta["tokens"]), num_hidden_layers=1, intermediate_size=32)
    if arch == "llama":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "gemma3":
        cfg["layer_types"] = None
    make_checkpoint(folder / "hf", arch, **cfg)  # (its tokenizer.json stays beside the weights, not the GGUF)
    return write_gguf(folder / "hf", folder / "tok.gguf", tokenizer=meta)


def assert_same_tokenizer(path: Path) -> Tokenizer:
    ours = gguf_tokenizer(open_gguf(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.vocab() == theirs.get_vocab()
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token == theirs.bos_token and ours.eos_token == theirs.eos_token
    return ours


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "default"])
def test_byte_level_bpe_equals_transformers(pre: str, tmp_path: Path) -> None:
    path = write(tmp_path / pre, "llama", byte_level_metadata(pre))
    ours = assert_same_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                             tokenize=False)
    assert ours.eos_token_ids == (2,)
    ids = ours.encode(ours.apply_chat_template(MESSAGES))
    assert ids.count(1) == 3  # <|im_start|> stays one (special) token


def test_pre_tokenizers_split_differently(tmp_path: Path) -> None:
    """The pre-tokenizer name matters: qwen2 splits digits one by one, llama-bpe in threes, GPT-2 not at all."""
    pieces = {pre: gguf_tokenizer(open_gguf(write(tmp_path / pre, "llama", byte_level_metadata(pre))))
              .encode("12345 4444") for pre in ("qwen2", "llama-bpe", "default")}
    assert len(set(map(tuple, pieces.values()))) == 3


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_sentencepiece_equals_transformers(arch: str, tmp_path: Path) -> None:
    path = write(tmp_path / arch, arch, sentencepiece_metadata(gemma=arch == "gemma3"))
    ours = assert_same_tokenizer(path)
    ids = ours.encode("\u2603 \u4e2d \u1e9e", add_special_tokens=True)  # characters the vocabulary lacks
    assert ids[0] == ours.token_to_id(ours.bos_token)  # add_bos_token
    spelled = {i: t for t, i in ours.vocab().items()}
    assert any(spelled[i].startswith("<0x") for i in ids)  # they fall back to byte tokens


def test_incremental_detokenization_and_settable_template(tmp_path: Path) -> None:
    tok = gguf_tokenizer(open_gguf(write(tmp_path / "g", "gemma3", sentencepiece_metadata(gemma=True))))
    text = "Le café naïve 日本語 🤖 and  spaces\n"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids) == text
    with pytest.raises(ChatTemplateError):  # a base model's file has no chat template
        tok.apply_chat_template(MESSAGES)
    tok.chat_template = TEMPLATE  # a catalog can give it one
    assert tok.apply_chat_template(MESSAGES).endswith("<|im_start|>assistant\n")
