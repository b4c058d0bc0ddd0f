"""Renderers of docs/benchmarks.md's engine sections: one function per kept result (benchmarks/results/NAME.json),
each returning the Markdown between `<!-- results:NAME -->` and `<!-- /results:NAME -->`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from report_format import num, pair, provenance, ratio, table, yes


def render_decode(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = [[f"{m['model']} ({m['parameters'] / 1e6:.1f}M parameters)", num(m["engine_decode_tok_s"]),
             num(m["transformers_decode_tok_s"]), ratio(m["decode_ratio"]), num(m["engine_prefill_tok_s"]),
             num(m["transformers_prefill_tok_s"]), ratio(m["prefill_ratio"])] for m in r["models"]]
    paths = [[t, num(p["gather_us"]), num(p["grouped_us"]), ratio(p["gather_us"] / p["grouped_us"])]
             for t, p in r["moe_paths_us"].items()]
    return "\n".join([
        provenance(rec), "",
        table(["model", "engine decode tok/s", "transformers decode tok/s", "ratio", "engine prefill tok/s",
               "transformers prefill tok/s", "ratio"], rows), "",
        "The two torch MoE paths, same run, µs per call (64 experts, top-8, D 512, I 256):", "",
        table(["tokens", "gather (copy k experts per token, bmm)", "grouped (sort by expert, grouped GEMM)",
               "gather ÷ grouped"], paths)])


def render_session_append(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for key, label in (("no_window", "persistent, no window"),
                       ("window_1024", "persistent, window 1024 + 4 sinks (rolling)")):
        v = r[key]
        rows.append([label, num(v["turn_ms_first10"], 2), num(v["turn_ms_mid10"], 2), num(v["turn_ms_last10"], 2),
                     f"{v['last10_over_first10']:.3f}", f"{v['last10_over_mid10']:.3f}"])
    st = r["stateless_turn_ms"]
    rows.append(["stateless (re-prefill the whole history each turn), sampled turns",
                 "; ".join(f"turn {t}: {num(ms, 2)}" for t, ms in st.items()), "", "", "", ""])
    s = r["stream"]
    stream = table(["", "at 1k tokens", f"at {num(s['stream_tokens'])} tokens", "ratio"],
                   [["KV pages held (16 tokens each)", s["pages_held_1k"], s["pages_held_end"],
                     "constant" if s["pages_held_1k"] == s["pages_held_end"] else "grew"],
                    ["one-token step, ms", num(s["step_ms_1k"], 3), num(s["step_ms_end"], 3),
                     ratio(s["step_time_ratio_end_vs_1k"])]])
    emb = r.get("embedding_chunks", {})
    return "\n".join([
        provenance(rec), "",
        f"{r['sessions']} sessions × {r['turns']} turns, {r['turn_input']} tokens in and {r['turn_output']} out a "
        f"turn, {r['threads']} threads:", "",
        table(["variant", "first 10 turns, ms/turn", "10 turns from a third in", "last 10 turns",
               "last10 ÷ first10", "last10 ÷ a third in"], rows), "",
        f"Stateless ÷ persistent at turn {r['turns']}: {ratio(r['stateless_over_persistent_at_last_turn'])} "
        f"({num(st[str(r['turns'])], 1)} against {num(r['persistent_turn_ms_last'], 1)} ms).", "",
        f"A stream of {num(s['stream_tokens'])} tokens through one session (window {s['window']}, {s['sinks']} "
        "sinks, rolling):", "", stream,
        *(["", "Embedding chunks (the same 64 positions as token ids and as vectors; then a windowed stream of "
           "vector chunks): " + ", ".join(f"`{k}` {v}" for k, v in emb.items()) + "."] if emb else [])])


def render_batch_invariance(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for dtype in ("float32", "bfloat16"):
        v = r[dtype]
        drift = v["max_logit_drift_by_batch"]
        rows.append([dtype, " / ".join(f"{drift[b]:.1e}" for b in sorted(drift, key=int) if b != "1"),
                     f"{v['greedy_identical_sessions']} / {v['sessions']}"])
    return "\n".join([provenance(rec), "",
                      table(["dtype", "largest logit drift, batch " + " / ".join(
                          b for b in sorted(r["float32"]["max_logit_drift_by_batch"], key=int) if b != "1"),
                          "replies identical to alone"], rows)])


def render_speculative(rec: dict[str, Any]) -> str:
    r = rec["result"]
    out = [provenance(rec), "", f"{r['tokens']} tokens, medians of {r['reps']} alternating runs."]
    for key, label in (("low_entropy", "(a) low entropy"), ("free", "(b) free generation")):
        rows = [[d.split("/")[-1].replace("default-draft", "draft model (shipped)"), num(v["tok_s"]),
                 ratio(v["speedup"]), f"{v['mean_accepted']:.2f}", yes(v["identical_to_none"])]
                for d, v in r[key].items()]
        out += ["", table([label, "tok/s", "vs none", "mean accepted", "identical to none"], rows)]
    return "\n".join(out)


def render_step_costs(rec: dict[str, Any]) -> str:
    r = rec["result"]
    sizes = sorted(int(k.split("_")[1]) for k in r if k.startswith("threads_") and k.endswith("_tokens_ms"))
    many = str(r["threads"])
    rows = [[n, r[f"threads_{n}_tokens_ms"]["1"], r[f"threads_{n}_tokens_ms"][many],
             r[f"threads_{n}_tokens_ms"]["many_over_one"]] for n in sizes]
    v, d32 = r["verify_ms"], r["decode_32_sessions_ms"]
    costs = [["verification of T tokens (all logits) against a one-token step, 290 tokens cached",
              "; ".join(f"{t}: {ms} ms" for t, ms in v.items()),
              ", ".join(f"r({t}) {x}" for t, x in r["verify_ratio"].items())],
             ["a decode step of 32 sessions: one padded attention call against one per session",
              f"{d32['batched_attention']} vs {d32['per_session']} ms", f"{d32['per_session_over_batched']}×"]]
    if "draft_forward_ms" in r:
        draft = r["draft_forward_ms"]
        costs.append(["the shipped draft model's one-token forward against the target's (both eager)",
                      f"{draft['draft']} vs {draft['target']} ms", f"{draft['draft_over_target']}"])
    return "\n".join([provenance(rec), "", table(["", "measured", "ratio"], costs), "",
                      table(["step tokens", "1 thread ms", f"{many} threads ms", f"{many} threads ÷ 1"], rows), "",
                      f"All threads pay from **{r['threads_pay_from_tokens']} tokens** on (every larger step "
                      "ran faster on them): `CPU_SMALL_STEP_TOKENS`."])


def render_moe_cpu(rec: dict[str, Any]) -> str:
    r = rec["result"]
    paths = ("topk_loop", "grouped", "gather")
    rows = []
    for t, row in r["tokens"].items():
        best = min(paths, key=lambda p: row[f"{p}_ms"])
        rows.append([t, num(row["transformers_ms"], 2),
                     *[(f"**{num(row[f'{p}_ms'], 2)}**" if p == best else num(row[f"{p}_ms"], 2)) for p in paths],
                     ratio(row[f"{best}_speedup"])])
    return "\n".join([provenance(rec), "",
                      f"Shape `{r['shape']}`: {r['num_experts']} experts, top-{r['num_experts_per_tok']}, D "
                      f"{r['hidden_size']}, I {r['moe_intermediate_size']}; {r['threads']} threads, ms per call.", "",
                      table(["T", "transformers", "top-k loop", "grouped", "gather", "best ÷ transformers"], rows)])


def render_cpu_decode(rec: dict[str, Any]) -> str:
    res = rec["result"]
    out = [provenance(rec)]
    for model in ("smollm2-135m-instruct", "default"):
        if model not in res:
            continue
        r = res[model]
        names = [k for k, v in r.items() if isinstance(v, dict) and "tok_s" in v]
        rows = []
        for n in names:
            c = r[n]
            comp = c.get("compile")
            compiled = ("" if comp is None else
                        f"{'+'.join(str(s) for s in comp['compile_s']) or '-'} s"
                        f"{', failed' if comp['failed'] else ''}; {comp['timed_steps_eager']} timed steps eager"
                        f"{'' if c.get('same_tokens_as_eager', True) else '; tokens differ from eager'}")
            rows.append([f"`{n}`", f"{c['weight_bytes_per_token'] / 1e6:.0f} MB", c["tok_s"],
                         f"{min(c['tok_s_reps'])}–{max(c['tok_s_reps'])}", f"{c['bandwidth_fraction']:.0%}",
                         f"{c['matching_prefix']}/{c['tokens']}", compiled])
        out += [f"\n**{model}** ({Path(r['path']).name}; read rate during its reps: copy "
                f"{r['read_rate']['copy_read_gb_s']} GB/s)\n",
                table(["contender", "weights read/token", "tok/s (median)", "reps", "of the copy's read rate",
                       "greedy tokens as float32", "compiled: compile seconds; check"], rows)]
        ratios = r["ratios"]
        keep = [k for k in ratios if k.endswith(("_over_llamacpp", "_over_transformers_fp32"))
                or k == "engine_defaults_over_engine_auto"]
        out.append("\nRatios (tok/s, same run): " + ", ".join(f"{k.removeprefix('engine_')} **{ratios[k]}×**"
                                                            for k in keep) + ".")
        peer = r.get("llamacpp", {}).get("build")
        if peer:
            out.append(f"\nllama.cpp: llama-cpp-python {peer['llama_cpp_python']} built with "
                       f"{', '.join(peer['features'])}.")
    return "\n".join(out)


def render_compile_background(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for key, label in (("baseline", "eager, no compile running (`--cpu-compile off`)"),
                       ("during_cold_compile", "while a cold compile runs (the default: the worker at SCHED_IDLE, "
                        "stopped while the engine works)"),
                       ("during_cold_compile_normal_priority", "while a cold compile runs, the worker at normal "
                        "priority, never stopped"),
                       ("warm_start", "a second start, its compiled step in the cache"),
                       ("compiled", "compiled, once ready")):
        if key in r:
            p = r[key]
            rows.append([label, p["ticks"], p["p50_ms"], p["p95_ms"], p["max_ms"], p["deadline_misses"]])
    cold, warm = r["during_cold_compile"], r["warm_start"]
    normal = r.get("during_cold_compile_normal_priority")
    return "\n".join([
        provenance(rec), "",
        table(["the loop's ticks (200 ms period)", "ticks", "p50 ms", "p95 ms", "max ms", "deadline misses"], rows),
        "", f"Model {r['model']}. A cold compile took {cold['compile_s']} s in the worker while the loop ran (the "
            f"engine served compiled {cold['ready_after_s']} s after its load); a second start in a fresh process "
            f"loaded the library that compile left ({warm.get('workers', '?')} workers started) and served compiled "
            f"{warm['ready_after_s']} s after its load ({warm['load_s']} s to load)."
            + (f" At normal priority the cold compile took {normal['compile_s']} s." if normal else "")])


def render_real_models(rec: dict[str, Any]) -> str:
    r = rec["result"]
    names = [k for k, v in r.items() if isinstance(v, dict) and "file" in v]
    rows, kv_rows, lengths = [], [], []
    for n in names:
        v = r[n]
        rows.append([f"{n} (`{v['file']}`)", pair(v["load_s"], v["hf_load_s"]),
                     pair(v["ours_decode_tok_s"], v["hf_decode_tok_s"]), ratio(v["decode_ours_over_hf"]),
                     pair(v["ours_prefill_tok_s"], v["hf_prefill_tok_s"], 0), ratio(v["prefill_ours_over_hf"])])
        for label, kv in ((n, v["kv_bytes"]), (f"{n}, no native window freeing",
                                               v.get("kv_bytes_without_window_freeing"))):
            if kv:
                lengths = list(kv)
                kv_rows.append([label, *(f"{b / 1e6:.1f} MB" for b in kv.values())])
    out = [provenance(rec), "",
           table(["model", "load s (ours / transformers)", "decode tok/s (ours / transformers)", "ratio",
                  "prefill tok/s (ours / transformers)", "ratio"], rows), "",
           "KV bytes a session holds (float32):", "",
           table(["model", *(f"at {num(int(t))} tokens" for t in lengths)], kv_rows)]
    for n in names:
        w = r[n].get("session_workload")
        if w:
            out += ["", f"The session workload on {n} ({w['sessions']} sessions × {w['turns']} turns of "
                        f"`session_append.py`): persistent turn {num(w['turn_ms_first10'])} ms over the first 10 "
                        f"turns, {num(w['turn_ms_last10'])} over the last 10 ({w['last10_over_first10']:.2f}×); the "
                        f"stateless re-prefill at the last turn {num(w['stateless_turn_ms_last'])} ms, "
                        f"{ratio(w['stateless_over_persistent_at_last_turn'])} the persistent turn."]
    return "\n".join(out)


def render_training(rec: dict[str, Any]) -> str:
    """A shipped checkpoint's training.json (written by the training run itself), not a benchmark's result."""
    t = rec["result"]
    a = t.get("args", {})
    shape = ", ".join(f"{k} {a[k]}" for k in ("hidden", "layers", "experts", "top_k") if k in a)
    return (f"From `{rec['command']}`: {t['parameters'] / 1e6:.2f}M parameters ({shape}), {t['steps']:,} steps of "
            f"{t['batch']} × {t['seq']} tokens ({t['tokens_seen'] / 1e6:.1f}M tokens of a "
            f"{t['corpus_tokens'] / 1e6:.2f}M-token corpus, {t['corpus']}), {t['train_seconds']} s on the CPU "
            f"(torch {t['torch']}); final training loss {t['final_train_loss']:.2f}, held-out loss "
            f"{t['validation_loss']:.2f} nats/token.")


def render_quant_accuracy(rec: dict[str, Any]) -> str:
    r = rec["result"]
    out = [provenance(rec)]
    for model, rows in r["models"].items():
        out += ["", f"**{model}** (greedy agreement over {r['tokens']} tokens):", "",
                table(["mode", "weights read a token", "perplexity, KJV (÷ float)", "perplexity, English (÷ float)",
                       "greedy agreement with float"],
                      [[f"`{mode}`", f"{v['weight_mb']} MB", f"{v['ppl_kjv']:.3f} ({v['ppl_kjv_ratio']:.3f})",
                        f"{v['ppl_english']:.3f} ({v['ppl_english_ratio']:.3f})", f"{v['greedy_agreement']:.3f}"]
                       for mode, v in rows.items()])]
    return "\n".join(out)


def render_policy_training(rec: dict[str, Any]) -> str:
    """default-policy's training.json (behaviour cloning of the scripted expert)."""
    t = rec["result"]
    m, d, e = t.get("model", {}), t.get("data", {}), t.get("eval", {})
    out = (f"From `{rec['command']}`: {m.get('parameters', 0) / 1e3:.0f}k parameters ({m.get('layers')} layers, "
           f"hidden {m.get('hidden')}), {t['steps']:,} steps of {t['batch']} on {num(d.get('tokens'))} tokens of "
           f"{num(d.get('episodes'))} expert episodes, {t['train_seconds']:.0f} s on {t.get('threads')} threads; final "
           f"loss {t['loss']:.3f}, first command error {t['first_command_error_rad_s']} rad/s.")
    if e:
        out += (f" Evaluation through the engine on {e.get('episodes', '?')} fixed seeded episodes: target reached in "
                f"{e.get('success_rate', 0):.0%} (the scripted expert: {e.get('expert_success_rate', 0):.0%}).")
    return out


RENDERERS = {"decode": render_decode, "session_append": render_session_append,
             "batch_invariance": render_batch_invariance, "speculative": render_speculative,
             "step_costs": render_step_costs, "moe_cpu_qwen3": render_moe_cpu, "moe_cpu_moe64": render_moe_cpu,
             "cpu_decode": render_cpu_decode, "compile_background": render_compile_background,
             "real_models": render_real_models, "quant_accuracy": render_quant_accuracy}
