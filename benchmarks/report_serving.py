"""Renderers of docs/benchmarks.md's serving sections (many sessions, the server's overhead, OpenAI's HTTP APIs,
robots): one function per kept result, each returning the Markdown between its markers."""

from __future__ import annotations

from typing import Any

from report_format import num, pair, provenance, ratio, table, yes


def level_rows(levels: list[dict[str, Any]], replies: bool = True) -> list[list[Any]]:
    rows = []
    for v in levels:
        row = [v["sessions"], num(v["chunks"]), pair(v["append_p50_ms"], v["append_p99_ms"]),
               f"{num(v['missed_deadlines'])} ({v['missed_share']:.1%}), {v.get('sessions_missing_deadlines', '–')} "
               "sessions"]
        if replies:
            row += [num(v.get("ttft_p50_ms")), pair(v.get("itl_p50_ms"), v.get("itl_p99_ms"))]
        rows.append([*row, v["tokens_per_step"]])
    return rows


def render_concurrency(rec: dict[str, Any]) -> str:
    r = rec["result"]
    head = ["N", "chunks", "append p50 / p99 ms", "missed deadlines", "TTFT p50 ms", "ITL p50 / p99 ms",
            "tokens / step"]
    out = [provenance(rec), "", f"{r['dtype']}, {r['seconds_per_level']:.0f} s per level, levels in the order run:",
           "", table(head, level_rows(r["levels"])), "",
           f"**Largest N held without a missed deadline: {r['largest_n_without_missed_deadline']}** (the smallest "
           f"that missed some: {r['smallest_n_with_missed_deadline']})."]
    if r.get("flood"):
        rows = []
        for f in r["flood"]:
            a, w = f["without_flood"], f["with_flood"]
            rows.append([f["step_tokens"], pair(a["append_p50_ms"], a["append_p99_ms"]),
                         f"{a['missed_deadlines']} / {a['chunks']}", pair(w["append_p50_ms"], w["append_p99_ms"]),
                         f"{w['missed_deadlines']} / {w['chunks']} ({w['sessions_missing_deadlines']} of "
                         f"{w['sessions']} sessions)", num(w.get("flood_tokens_per_s"))])
        out += ["", "The flood case, a fresh engine per step budget:", "",
                table(["step tokens", "p50 / p99 ms alone", "missed alone", "p50 / p99 ms with the flood",
                       "missed with the flood", "flood tokens/s"], rows)]
    return "\n".join(out)


def render_ws_overhead(rec: dict[str, Any]) -> str:
    r = rec["result"]
    overhead = table(["beyond the engine's compute", "p50 ms", "p99 ms"],
                     [["server + protocol + client + loopback", r["server_overhead_p50_ms"],
                       r["server_overhead_p99_ms"]],
                      ["the engine's asyncio API alone", r["engine_api_overhead_p50_ms"],
                       r["engine_api_overhead_p99_ms"]]])
    rates = table(["connections", "acks / s", "round trip p50 / p99 ms"],
                  [[v["connections"], num(v["acks_per_s"]), pair(v["rtt_p50_ms"], v["rtt_p99_ms"], 2)]
                   for v in r["sustained"]])
    return "\n".join([provenance(rec), "", f"Chunks of {r['chunk_tokens']} tokens.", "", overhead, "", rates])


def render_responses_chain(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for label, v in (("chain, full reply", r["chain"]), ("stateless, full reply", r["baseline"]),
                     ("chain, first text", r["first_text"]["chain"]),
                     ("stateless, first text", r["first_text"]["baseline"])):
        rows.append([label, num(v["first10_ms"]), num(v["last10_ms"]), f"{v['last10_over_first10']:.3f}",
                     num(v["last_ms"])])
    c = r["chain"]
    return "\n".join([
        provenance(rec), "",
        f"{r['turns']} turns on {r['model']}, replies of {r['max_tokens']} tokens, engine "
        f"{r['engine']['dtype']}:", "",
        table(["", "first 10 turns, ms", "last 10 turns, ms", "last10 ÷ first10", f"turn {r['turns']}, ms"], rows),
        "",
        f"At turn {r['turns']} ({num(c['input_tokens_at_last'])} tokens of context) the chain's turn costs "
        f"{ratio(r['stateless_over_chain_at_last'])} less than the stateless one to the full reply and "
        f"{ratio(r['first_text']['stateless_over_chain_at_last'])} less to the first text. Follow-ups that reused "
        f"the previous context: {c['turns_continued']} of {r['turns'] - 1} (`cached_tokens` at the last turn "
        f"{num(c['cached_tokens_at_last'])}); the stateless client's `cached_tokens` stayed "
        f"{r['baseline']['cached_tokens_max']}. Replies identical between the two: {r['same_replies']} of "
        f"{r['turns']}."])


def render_robot_loop(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = []
    for v in r["levels"]:
        acc = v.get("draft_acceptance")
        rows.append([f"{v['hz']:.0f} Hz", v["robots"], pair(v["latency_ms_p50"], v["latency_ms_p99"]),
                     f"{num(v['fresh_replies'])} of {num(v['requests'])}", f"{v['fresh_tick_share']:.1%}",
                     f"{v['forwards_per_chunk']}" + (f" ({acc:.0%})" if acc is not None else ""),
                     f"{round(v['success_rate'] * v['episodes'])} of {v['episodes']}", v["missed_ticks"],
                     yes(v["held"])])
    held = ", ".join(f"{n if n is not None else 0} at {float(hz):.0f} Hz" for hz, n in r["held_max"].items())
    s = r["stateless"]
    ms = s["ms_per_tick"]
    tokens = s["tokens_per_tick"]
    stateless = table(["per tick", "stateful session",
                       f"stateless, whole history ({num(tokens['full_history'])} tokens)",
                       f"stateless, window tail ({tokens['window_tail']} tokens)"],
                      [["time", f"{ms['stateful']} ms", f"{ms['full_history']} ms ({s['cost_ratio_full_history']}×)",
                        f"{ms['window_tail']} ms ({s['cost_ratio_window_tail']}×)"],
                       ["same actions as the session", "—", s["same_actions"]["full_history"],
                        s["same_actions"]["window_tail"]]])
    out = [provenance(rec), "",
           f"Model `{r['model']}`, {r['seconds']:.0f} s per level, real-time chunking prefix {r['rtc']}:", "",
           table(["rate", "robots", "latency p50 / p99 ms", "fresh replies", "ticks served",
                  "forwards per chunk (draft accepted)", "success", "missed ticks", "held"], rows), "",
           f"**Held: {held}.**"]
    if not r["rtc"]:  # the in-process comparison does not depend on the loops' settings: shown once
        out += ["", f"Stateful against stateless at step {num(s['step'])} (in process, {s['ticks_measured']} ticks "
                    "measured):", "", stateless]
    return "\n".join(out)


def render_rolling_batch(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = [[v["robots"], v["ms_per_step"]["batched"], v["ms_per_step"]["per_session"], ratio(v["speedup"]),
             yes(v["same_tokens"])] for v in r["levels"]]
    return "\n".join([provenance(rec), "", f"`{r['model']}`, {r['tokens']} constrained tokens per robot:", "",
                      table(["robots", "one call for all (ms per step)", "one call per robot", "speedup",
                             "tokens identical"], rows)])


RENDERERS = {"concurrency": render_concurrency, "ws_overhead": render_ws_overhead,
             "responses_chain": render_responses_chain, "robot_loop": render_robot_loop,
             "robot_loop_rtc2": render_robot_loop,
             "rolling_batch": render_rolling_batch}
