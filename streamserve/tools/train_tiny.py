"""Train the embedded default model: a tiny Qwen3-MoE on the King James Bible, on CPU, in minutes.

    python -m streamserve.tools.train_tiny --out streamserve/assets/default

The text comes from Debian's `bible-kjv-text` (read with the `bible` program of `bible-kjv`:
`apt-get install bible-kjv`), or from any UTF-8 file given with `--text`. The script trains a
byte-level BPE tokenizer with `tokenizers`, then a `Qwen3MoeForCausalLM` with `transformers`
(the `train` extra), and writes a Hugging Face checkpoint: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json and training.json (the figures).
The same script with other sizes trains a draft model sharing the tokenizer (`--tokenizer PATH`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
# Plain turns ("User: ...", "Assistant:"): the corpus has no chat format, yet chat sessions and /v1/realtime need a
# template to lay a conversation out on one session; every rendering extends the previous one (incremental).
CHAT_TEMPLATE = ("{%- for message in messages -%}{{ message['role'] | capitalize }}: {{ message['content'] | trim }}"
                 "{{ '\\n\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}Assistant:{%- endif -%}")
SPECIAL_TOKENS = [EOS]


def kjv_text() -> str:
    """The whole KJV as plain verses: one verse a line, chapters separated by a blank line."""
    if shutil.which("bible") is None:
        sys.exit("error: the `bible` program is missing; install the text with `apt-get install bible-kjv` "
                 "(it brings bible-kjv-text), or pass --text FILE")
    raw = subprocess.run(["bible", "-l1000", "gen1:1-rev22:21"], check=True, capture_output=True,
                         text=True).stdout
    chapters: list[list[str]] = []
    for line in raw.splitlines():
        line = line.strip()
        if not line:
            continue
        if re.fullmatch(r"(?:[1-3] )?[A-Z][A-Za-z ]+ \d+", line):  # a chapter header: "1 Kings 3"
            chapters.append([])
        elif m := re.match(r"^(\d+)\s+(.*)$", line):  # a verse: "3 And God said, ..."
            chapters[-1].append(m.group(2))
        else:  # a wrapped continuation line
            chapters[-1][-1] += " " + line
    return "\n\n".join("\n".join(verses) for verses in chapters if verses) + "\n"


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tok


def build_model(args: argparse.Namespace, vocab_size: int, eos_id: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        intermediate_size=args.moe_intermediate * 2, moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=args.max_positions, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=eos_id, eos_token_id=eos_id, output_router_logits=True,
        router_aux_loss_coef=args.aux_loss, rms_norm_eps=1e-6,
    )
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(config)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m streamserve.tools.train_tiny", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder for the checkpoint")
    p.add_argument("--text", type=Path, help="train on this UTF-8 file instead of the KJV")
    p.add_argument("--tokenizer", type=Path, help="reuse this tokenizer.json (for a draft model)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128, help="training sequence length")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-loss", type=float, default=0.01, help="router load-balancing loss coefficient")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    text = args.text.read_text(encoding="utf-8") if args.text else kjv_text()
    if args.tokenizer:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(args.tokenizer))
    else:
        tok = train_tokenizer(text, args.vocab)
    eos_id = tok.token_to_id(EOS)
    docs = text.split("\n\n")
    random.Random(args.seed).shuffle(docs)  # the held-out tail is then a sample of the corpus, not its end
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = max(len(data) // 50, args.seq + 2)  # the last 2% (at least one sequence) is held out
    if len(data) < n_val + args.seq + 2:
        sys.exit(f"error: the corpus has {len(data)} tokens, too few for --seq {args.seq}")
    train, val = data[:-n_val], data[-n_val:]
    print(f"corpus: {len(text):,} chars, {len(data):,} tokens, vocab {tok.get_vocab_size()}", flush=True)

    model = build_model(args, tok.get_vocab_size(), eos_id)
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    gen = torch.Generator().manual_seed(args.seed)

    def batch(source: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(0, len(source) - args.seq, (args.batch,), generator=gen)
        return torch.stack([source[s: s + args.seq] for s in starts.tolist()])

    t0 = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        x = batch(train)
        out = model(input_ids=x, labels=x, output_router_logits=True)  # transformers shifts the labels
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == args.steps:
            el = time.perf_counter() - t0
            print(f"step {step}/{args.steps} loss {out.loss.item():.3f} "
                  f"({step * args.batch * args.seq / el:,.0f} tok/s, eta {el / step * (args.steps - step):.0f}s)",
                  flush=True)
    train_s = time.perf_counter() - t0

    # Validation loss without the auxiliary router loss: the language-model loss alone (nats/token).
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b, output_router_logits=False).loss.item()
                  for b in (batch(val) for _ in range(8))]
    val_loss = sum(losses) / len(losses)
    print(f"validation loss {val_loss:.3f} nats/token, {train_s:.0f}s of training", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.to(getattr(torch, args.save_dtype)).save_pretrained(args.out)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
        "model_max_length": args.max_positions, "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    (args.out / "training.json").write_text(json.dumps({
        "corpus": str(args.text) if args.text else "King James Bible (Debian bible-kjv-text)",
        "corpus_tokens": len(data), "parameters": n_params, "steps": args.steps, "batch": args.batch,
        "seq": args.seq, "tokens_seen": args.steps * args.batch * args.seq,
        "final_train_loss": round(out.loss.item(), 4), "validation_loss": round(val_loss, 4),
        "train_seconds": round(train_s), "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB)", flush=True)


if __name__ == "__main__":
    main()
