"""Train the default robot policy: behaviour cloning of the simulated arm's scripted expert, on CPU, in minutes.

    python -m streamserve.tools.train_policy --out streamserve/assets/default-policy

The task (streamserve/robot/arm.py): a planar two-link arm at 50 Hz must bring its hand to a target given in the
observation. The script generates expert episodes (with noise on the executed commands so the data covers the
states a slightly wrong policy drifts into), builds a word-level tokenizer (markers, a few prompt words, the state
bins, the action bins), and trains a tiny Llama (transformers' LlamaForCausalLM) on the token streams those
episodes put on a session, cropped exactly as a rolling `[sinks | window]` session presents them, with the loss
on the action tokens only. It writes a checkpoint the engine loads: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, policy.json (the codec) and training.json (what it did), and finally
runs the policy in closed loop through the real engine on seeded episodes and records its success rate.

Needs the `train` extra (transformers). Training on another robot: replace the episode generator and the state
and action ranges; the codec and the crop layout stay.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from streamserve.robot import arm
from streamserve.robot.codec import PolicyCodec
from streamserve.robot.dataset import Stream, expert_stream, query_ends, training_crop

SPECIALS = ["<pad>", "<unk>", "<eos>", "<task>", "<obs>", "<act>"]
WORDS = ["reach", "the", "target", "move", "hand", "to", "touch", "go", "goal", "for", "point", "arm", "a", "your",
         "please", "now"]


def build_tokenizer(state_bins: int, action_bins: int):
    """A word-level tokenizer: ids 0..5 the special and marker tokens, then the words, the state bins
    (<s0>..), the action bins (<a0>..). -> (tokenizer, state offset, action offset)."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

    names = SPECIALS + WORDS
    state_off = len(names)
    names += [f"<s{i}>" for i in range(state_bins)]
    action_off = len(names)
    names += [f"<a{i}>" for i in range(action_bins)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # markers and bins are whole tokens that text never splits into (and decoding skips as special)
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names
                            if n.startswith("<") and n not in ("<unk>",)])
    return tok, state_off, action_off


def make_codec(state_off: int, action_off: int, args: argparse.Namespace) -> PolicyCodec:
    return PolicyCodec(
        state_key=arm.STATE_KEY, state_low=tuple(float(x) for x in arm.STATE_LOW),
        state_high=tuple(float(x) for x in arm.STATE_HIGH), state_bins=args.state_bins, state_token_offset=state_off,
        action_dims=2, action_horizon=args.horizon, action_low=arm.ACTION_LOW, action_high=arm.ACTION_HIGH,
        action_bins=args.action_bins, action_token_offset=action_off, obs_token=SPECIALS.index("<obs>"),
        act_token=SPECIALS.index("<act>"), task_token=SPECIALS.index("<task>"), prompt_key=arm.PROMPT_KEY,
        default_prompt=arm.PROMPT, window=args.window, sinks=args.sinks, control_hz=1.0 / arm.DT)


def build_model(args: argparse.Namespace, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_positions, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=0, bos_token_id=SPECIALS.index("<eos>"),
        eos_token_id=SPECIALS.index("<eos>"), attention_bias=False, mlp_bias=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def smooth_bin_embeddings(model, codec: PolicyCodec, seed: int, features: int = 16) -> None:
    """Start each bin's embedding from its value: Fourier features of the bin centre, through a random projection
    per block (state, action), over the random init. Neighbouring bins then start out alike, so what the model
    learns about one value carries over to the next (a table of independent rows learns no such order), and
    through the tied output head the logits of neighbouring action bins move together."""
    emb = model.get_input_embeddings().weight  # [V, hidden], tied to the output head
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for offset, bins in ((codec.state_token_offset, codec.state_bins),
                             (codec.action_token_offset, codec.action_bins)):
            u = (torch.arange(bins, dtype=torch.float32) + 0.5) / bins  # [bins] in (0, 1)
            k = torch.arange(1, features + 1, dtype=torch.float32)
            f = torch.cat([torch.sin(math.pi * u[:, None] * k), torch.cos(math.pi * u[:, None] * k)], 1)  # [bins, 2K]
            proj = torch.randn(2 * features, emb.shape[1], generator=g) / math.sqrt(2 * features)
            emb[offset:offset + bins] = 0.5 * emb[offset:offset + bins] + 0.1 * (f @ proj)


def batches(streams: list[Stream], codec: PolicyCodec, batch: int, rng: np.random.Generator,
            prefix_share: float = 0.0, prefix_noise: float = 0.0):
    """Endless batches of crops (input ids [B, T], labels [B, T]): a random stream, a random reply's end
    (`training_crop`: a random history length, earlier replies swapped, the loss on the last reply)."""
    ends = [query_ends(s) for s in streams]
    # rad/s -> bins (the default policy's dims share one range)
    noise_bins = prefix_noise * codec.action_bins / (codec.action_high[0] - codec.action_low[0])
    while True:
        rows = []
        for _ in range(batch):
            i = int(rng.integers(len(streams)))
            rows.append(training_crop(streams, i, int(rng.choice(ends[i])), codec.sinks, codec.window,
                                      codec.n_action_tokens, rng, codec.action_dims, prefix_share, noise_bins,
                                      (codec.action_ids[0], codec.action_ids[-1])))
        t = max(len(r[0]) for r in rows)
        ids = torch.zeros(batch, t, dtype=torch.long)  # right-padded with <pad> (0); causal: pads see, are unseen
        labels = torch.full((batch, t), -100, dtype=torch.long)
        for b, (x, y) in enumerate(rows):
            ids[b, :len(x)] = torch.from_numpy(x)
            labels[b, :len(y)] = torch.from_numpy(y)
        yield ids, labels


def write_tokenizer_config(out: Path, max_len: int) -> None:
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
           "eos_token": "<eos>", "bos_token": None, "add_bos_token": False, "model_max_length": max_len}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def evaluate(out: Path, episodes: int, log) -> dict:
    """Closed-loop success of the written checkpoint through the real engine, beside the expert's."""
    from streamserve.engine import Engine
    from streamserve.robot.rollout import engine_success_rate

    seeds = list(arm.EVAL_SEEDS[:episodes])
    codec = PolicyCodec.load(out)
    assert codec is not None
    every = codec.action_horizon  # the whole chunk runs open loop: the hardest (and cheapest) setting
    expert = arm.success_rate(seeds, lambda: arm.ExpertPolicy(codec.action_horizon), every)
    t0 = time.perf_counter()
    done: list[bool] = []

    def show(seed: int, r: arm.EpisodeResult) -> None:
        done.append(r.success)
        if len(done) % 10 == 0:
            log(f"  eval {len(done)}/{len(seeds)}: success {sum(done) / len(done):.0%}")

    with Engine.from_pretrained(out, device="cpu", drafter="none") as engine:
        rate = engine_success_rate(engine, seeds, every, show)
    return {"episodes": len(seeds), "seeds": [seeds[0], seeds[-1]], "replan_every": every, "success_rate": rate,
            "expert_success_rate": expert, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m streamserve.tools.train_policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder for the checkpoint")
    p.add_argument("--minutes", type=float, default=15.0, help="training time budget in minutes (default 15)")
    p.add_argument("--steps", type=int, default=2800, help="the most optimizer steps (default 2800)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data, the initial weights and the crops")
    p.add_argument("--episodes", type=int, default=600, help="expert episodes generated (default 600)")
    p.add_argument("--queries", type=int, default=60, help="policy calls per generated episode (default 60)")
    p.add_argument("--horizon", type=int, default=4, help="action chunk length H in ticks (default 4)")
    p.add_argument("--state-bins", type=int, default=128)
    p.add_argument("--action-bins", type=int, default=101, help="odd, so that 0 rad/s is a bin centre")
    p.add_argument("--window", type=int, default=64, help="the rolling window an episode's session keeps")
    p.add_argument("--sinks", type=int, default=8, help="the first tokens the session keeps for ever")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--first-step-weight", type=float, default=4.0, help="loss weight of each reply's first step")
    p.add_argument("--prefix-share", type=float, default=0.5,
                   help="share of crops whose last chunk starts with a forced prefix of the previous chunk's rows, "
                        "as real-time chunking sends it (default 0.5)")
    p.add_argument("--prefix-noise", type=float, default=1.0,
                   help="rad/s of Gaussian noise on a forced prefix's rows (its own errors at run time; default 1)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--eval-episodes", type=int, default=50, help="closed-loop episodes scored at the end (0: none)")
    args = p.parse_args(argv)
    if args.window + args.sinks > args.max_positions:
        p.error("--window + --sinks must not exceed --max-positions")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    tok, state_off, action_off = build_tokenizer(args.state_bins, args.action_bins)
    codec = make_codec(state_off, action_off, args)

    def tokenize(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    rng = np.random.default_rng(args.seed)
    streams = [expert_stream(rng, codec, tokenize, args.queries) for _ in range(args.episodes)]
    n_tokens = sum(len(s.ids) for s in streams)
    log(f"data: {len(streams)} expert episodes, {n_tokens} tokens, "
        f"{sum(int(s.is_action.sum()) for s in streams)} action tokens")

    vocab = tok.get_vocab_size()
    model = build_model(args, vocab)
    smooth_bin_embeddings(model, codec, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: Llama {args.layers} layers x {args.hidden} hidden, vocab {vocab}, {n_params / 1e6:.2f}M parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    budget = args.minutes * 60.0
    warmup = max(1, min(100, args.steps // 10))
    data = batches(streams, codec, args.batch, rng, args.prefix_share, args.prefix_noise)
    model.train()
    step, t_train, loss_avg, err_avg = 0, time.perf_counter(), float("nan"), float("nan")
    while step < args.steps:
        elapsed = time.perf_counter() - t_train
        if elapsed > budget:
            log(f"time budget of {args.minutes} min reached at step {step}")
            break
        # cosine decay over whichever comes first, the step count or the time budget
        frac = max(step / args.steps, elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = next(data)
        logits = model(input_ids=ids).logits[:, :, :]  # [B, T, V]
        mask = labels != -100
        # the first step's D commands (predicted at <act> and after) carry what the state decides; the later
        # steps mostly continue them: weigh the first step up
        weight = torch.ones(labels.shape)
        rows, cols = torch.nonzero((ids == codec.act_token) & mask, as_tuple=True)
        for d in range(codec.action_dims):
            weight[rows, cols + d] = args.first_step_weight
        per_token = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="none")
        loss = (per_token * weight[mask]).sum() / weight[mask].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():  # the first command of each reply (predicted at <act>): the one the state decides
            first = (ids == codec.act_token) & mask
            err = (logits[first].argmax(-1) - labels[first]).abs().float().mean().item()
            err = err * (codec.action_high[0] - codec.action_low[0]) / codec.action_bins
        loss_avg = loss.item() if math.isnan(loss_avg) else 0.95 * loss_avg + 0.05 * loss.item()
        err_avg = err if math.isnan(err_avg) else 0.95 * err_avg + 0.05 * err
        if step % 25 == 0 or step == 1:
            log(f"step {step}: loss {loss_avg:.3f}  first command error {err_avg:.3f} rad/s  lr {lr:.2e}")
    train_s = time.perf_counter() - t_train

    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save(str(args.out / "tokenizer.json"))
    write_tokenizer_config(args.out, args.max_positions)
    codec.save(args.out)
    report = {
        "task": "planar two-link arm reaching (streamserve.robot.arm), behaviour cloning of the scripted expert",
        "steps": step, "batch": args.batch, "loss": round(loss_avg, 4), "first_command_error_rad_s": round(err_avg, 4),
        "train_seconds": round(train_s, 1), "seed": args.seed, "lr": args.lr, "minutes": args.minutes,
        "first_step_weight": args.first_step_weight, "threads": args.threads, "prefix_share": args.prefix_share,
        "prefix_noise": args.prefix_noise,
        "data": {"episodes": args.episodes, "queries_per_episode": args.queries, "tokens": n_tokens},
        "model": {"architecture": "LlamaForCausalLM", "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "vocab": vocab, "parameters": n_params},
        "codec": {"horizon": args.horizon, "state_bins": args.state_bins, "action_bins": args.action_bins,
                  "window": args.window, "sinks": args.sinks},
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out} after {step} steps ({train_s:.0f}s of training)")
    if args.eval_episodes > 0:
        report["eval"] = evaluate(args.out, args.eval_episodes, log)
        (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        ev = report["eval"]
        log(f"closed loop through the engine: success {ev['success_rate']:.0%} on {ev['episodes']} episodes "
            f"(expert {ev['expert_success_rate']:.0%})")
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("steps", "loss", "train_seconds", "total_seconds")}
                     | {"success_rate": report.get("eval", {}).get("success_rate")}))


if __name__ == "__main__":
    main()
