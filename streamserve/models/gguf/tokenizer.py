"""A GGUF file's `tokenizer.ggml.*` metadata -> a `tokenizers` Tokenizer in streamserve's wrapper.

Two vocabulary kinds, built as transformers builds them from the same file (so both give the same ids):

- "gpt2": byte-level BPE. Tokens and merges are in the file; the text is split by the regex its
  `tokenizer.ggml.pre` names (GPT-2's own when the name has no regex of its own, e.g. smollm, default).
- "llama": SentencePiece-style BPE with byte fallback. The file has tokens, scores and token types
  but no merges: every token that two others concatenate to gives a merge, ranked by the token's
  score (Gemma: by the token's position, which is its merge order; its scores are not).

Control tokens (type 3) become special tokens, user-defined ones (type 4) added tokens matched whole.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from streamserve.errors import ModelLoadError
from streamserve.models.gguf.reader import GGUFFile
from streamserve.models.tokenizer import Tokenizer, byte_level_chars

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types
SPIECE_SPACE = "\u2581"

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with; absent names use GPT-2's (smollm, default)
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT}
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def gguf_tokenizer(f: GGUFFile) -> Tokenizer:
    kind = f.get("tokenizer.ggml.model")
    tokens: list[str] | None = f.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{f.path.name} has no tokenizer.ggml.tokens: streamserve needs the tokenizer in the file")
    types: list[int] = f.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{f.path.name}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} "
                             "tokens; the file is damaged")
    if kind == "gpt2":
        tok, spelled = _byte_level(f, tokens), _byte_alphabet()
        control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= spelled]
    elif kind == "llama":
        tok = _sentencepiece(f, tokens)
        control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    else:
        raise ModelLoadError(f"{f.path.name}: tokenizer kind {kind!r} is not supported (gpt2, llama)")
    # special: matched whole and dropped by decode(skip_special_tokens); user-defined: matched whole, kept
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    add_bos = f.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:  # llama.cpp's default: a SentencePiece vocabulary adds BOS unless the file says not to
        add_bos = kind == "llama"
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
    config: dict[str, Any] = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                              "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
                              "add_bos_token": bool(add_bos), "add_eos_token": add_eos}
    tok.post_processor = _post_processor(tok, config)
    return Tokenizer(tok, config, f.get("tokenizer.chat_template"))


def _byte_alphabet() -> set[str]:
    """The 256 printable characters byte-level BPE spells bytes with (GPT-2's table)."""
    return set(_byte_table().values())


def _byte_table() -> dict[int, str]:
    return dict(enumerate(byte_level_chars()))


def _byte_level(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges = f.get("tokenizer.ggml.merges") or []
    table = _byte_table()
    alphabet = set(table.values())
    # a token written in plain text (a mislabelled special one) is looked up in its byte spelling
    vocab = {t if set(t) <= alphabet else "".join(table[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(str(f.get("tokenizer.ggml.pre", "default")))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GGUFFile, tokens: list[str]) -> HFTokenizer:
    gemma = f.architecture in GEMMA_ARCHS
    if gemma:  # Gemma files store runs of spaces as spaces; its SentencePiece model spells them with U+2581
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {t: -float(i) for i, t in enumerate(tokens)}  # its tokens are listed in merge order
    else:
        scores = f.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            raise ModelLoadError(f"{f.path.name}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per "
                                 "token")
        ranks = dict(zip(tokens, (float(s) for s in scores), strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_from_ranks(vocab, ranks), unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    if gemma:  # no prefix space; spaces become U+2581 and each starts a new piece
        tok.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    else:  # Llama-style: a space is prepended to the text (not after special tokens) and stripped on decode
        prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE,
                                                     prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def _merges_from_ranks(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the whole token's score (best first;
    ties: longer left part, then longer right part first), as SentencePiece's BPE applies them."""
    found: list[tuple[str, str, float]] = []
    for token, score in ranks.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _post_processor(tok: HFTokenizer, config: dict[str, Any]) -> processors.TemplateProcessing:
    """BOS before / EOS after each sequence, as the file's add_bos_token / add_eos_token say."""
    specials: list[tuple[str, int]] = []
    before, after = [], []
    for flag, key, side in (("add_bos_token", "bos_token", before), ("add_eos_token", "eos_token", after)):
        t = config.get(key)
        tid = tok.token_to_id(t) if t else None
        if config.get(flag) and t and tid is not None:
            side.append(t)
            specials.append((t, tid))
    single = " ".join([*before, "$A", *after])
    pair = " ".join([*before, "$A", *after, *before, "$B:1", *after])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
