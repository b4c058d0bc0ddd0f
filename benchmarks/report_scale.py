"""Renderers of docs/benchmarks.md's scale and endurance sections: one instance against two behind nginx and the
hand-off under them (benchmarks/scale_out.py), the hand-off's steps (benchmarks/handoff_pause.py), sessions held per
kind (benchmarks/sessions_held.py) and the soak (benchmarks/soak.py). Each takes a kept result
(benchmarks/results/NAME.json) and returns the Markdown between `<!-- results:NAME -->` and `<!-- /results:NAME -->`;
parts a run may leave out (no hand-off, no SGLang, a kind skipped or failed) are skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from report_format import minutes, num, pair, provenance, ratio, table, yes


def spread(d: dict[str, Any] | None, digits: int = 0) -> str:
    """A `{"p50", "p99"}` dict as `p50 / p99`; dashes when it is missing."""
    d = d or {}
    return pair(d.get("p50"), d.get("p99"), digits)


def given(part: Any) -> bool:
    """A side run's dict that ran: present, and neither skipped nor failed."""
    return isinstance(part, dict) and bool(part) and "skipped" not in part and "failed" not in part


def errors(by_code: dict[str, int] | None) -> str:
    """`streamserve bench`'s or soak's errors by code: `0`, or each code with its count."""
    return ", ".join(f"{code} {n}" for code, n in sorted(by_code.items())) if by_code else "0"


def replies(every: int | None) -> str:
    """Text sessions' replies (`--reply-every`): the bench asks for 16 tokens every `every` chunks."""
    return f"a 16-token reply every {every} chunks" if every else "appends only"


def load(level: dict[str, Any]) -> str:
    la = level.get("load_avg_1m") or {}
    return f"{la.get('start', '?')}–{la.get('end', '?')}"


def latencies(level: dict[str, Any]) -> str:
    """A bench level's latency spreads, each measure's p50 / p99 in ms."""
    lat = level.get("latency_ms") or {}
    return "; ".join(f"{m.removesuffix('_ms').replace('_', ' ')} {spread(v)}" for m, v in lat.items()) or "–"


def level_rows(levels: list[dict[str, Any]], first: str) -> list[list[Any]]:
    """sessions_held.level_figures' dicts (or a failed level) as rows led by `first`."""
    rows = []
    for lv in levels:
        if "failed" in lv:
            rows.append([first, lv.get("sessions", "?"), "failed", "", str(lv["failed"])[:120], "", ""])
            continue
        rows.append([first, f"{lv.get('sessions', '?')} ({lv.get('held', '?')})", lv.get("missed_deadlines", "–"),
                     errors(lv.get("errors")), latencies(lv),
                     ", ".join(str(p) for p in lv["kv_pages_after_close"]) if "kv_pages_after_close" in lv else "",
                     load(lv)])
    return rows


LEVEL_HEAD = ["", "sessions (held)", "missed deadlines", "errors", "p50 / p99, ms", "KV pages after close",
              "load average"]


def render_scale_out(rec: dict[str, Any]) -> str:
    r = rec["result"]
    setups = r.get("setups", {})
    rows = [row for name, label in (("direct", "one instance"), ("nginx", "two behind nginx"))
            for row in level_rows(setups.get(name, {}).get("levels", []), label)]
    head = LEVEL_HEAD[:5] + LEVEL_HEAD[6:]  # the bench samples one of the two instances behind nginx: no pages
    out = [provenance(rec), "",
           f"Text sessions, model {r.get('model', '?')} ({replies(r.get('reply_every'))}), "
           f"{num(r.get('duration_s'), 0)} s a level, up to {r.get('tries', '?')} tries a level and setup:", "",
           table(head, [row[:5] + row[6:] for row in rows]), "",
           f"Sessions held at most: {r.get('held_direct_one_instance', '–')} on one instance, "
           f"{r.get('held_nginx_two_instances', '–')} on two behind nginx: ratio "
           f"{ratio(r['ratio']) if r.get('ratio') is not None else '–'}."]
    h = r.get("handoff")
    if given(h):
        toks = h.get("tokens_per_session") or []
        out += ["", "The hand-off behind nginx (`POST /admin/drain` of the instance holding the sessions):", "",
                table(["sessions", "tokens each", "drain → each one's first ack on the other instance, p50 / p99 ms",
                       "record bytes per 1,000 tokens", "drain status, the instance's exit"],
                      [[h.get("sessions", "?"), f"{min(toks)}–{max(toks)}" if toks else "–",
                        pair(h.get("pause_p50_ms"), h.get("pause_p99_ms"), 0), num(h.get("bytes_per_1k_tokens")),
                        f"{h.get('drain_status', '?')}, {h.get('drained_instance_exit', '?')}"]])]
    elif isinstance(h, dict) and h:
        out += ["", f"Hand-off: {h.get('skipped') or h.get('failed')}."]
    sg = r.get("sglang_vs_engine")
    if given(sg) and "engine_workload" in sg and "sglang_workload" in sg:
        out += ["", f"The SGLang backend against the engine (`sglang_vs_engine`: benchmarks/sglang_backend.py, "
                    f"{sg.get('sessions', '?')} sessions × {sg.get('turns', '?')} turns):", "", sglang_table(sg)]
    return "\n".join(out)


def sglang_table(sg: dict[str, Any]) -> str:
    """benchmarks/sglang_backend.py's figures (scale_out.py's `sglang_vs_engine`) side by side."""
    ea, sa = sg.get("engine_append", {}), sg.get("sglang_append", {})
    ew, sw = sg["engine_workload"], sg["sglang_workload"]
    cached = sw.get("sglang_cached_fraction_last")
    return "\n".join([
        table(["", "engine", "SGLang backend", "SGLang ÷ engine"],
              [["append, p50 / p99 ms", pair(ea.get("p50_ms"), ea.get("p99_ms")), pair(sa.get("p50_ms"),
                                                                                        sa.get("p99_ms")),
                ratio(sg["append_p50_ratio_sglang_over_engine"])
                if sg.get("append_p50_ratio_sglang_over_engine") else "–"],
               ["turn, p50 / p99 ms", pair(ew.get("turn_p50_ms"), ew.get("turn_p99_ms")),
                pair(sw.get("turn_p50_ms"), sw.get("turn_p99_ms")),
                ratio(sg["turn_p50_ratio_sglang_over_engine"]) if sg.get("turn_p50_ratio_sglang_over_engine") else "–"],
               [f"turns per second ({sg.get('sessions', '?')} sessions)", num(ew.get("turns_per_s")),
                num(sw.get("turns_per_s")), ""],
               ["last 10 turns ÷ first 10", num(ew.get("last10_over_first10"), 2),
                num(sw.get("last10_over_first10"), 2), ""]]), "",
        f"Greedy outputs identical: {yes(bool(sg.get('greedy_outputs_equal')))}"
        + (f"; SGLang served {cached:.2%} of each session's last request from its cache." if cached is not None
           else ".")])


def render_handoff_pause(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = [["snapshot (on the drained instance)", pair(r.get("a_snapshot_ms_p50"), r.get("a_snapshot_ms_p99"))],
            ["record write", pair(r.get("a_put_ms_p50"), r.get("a_put_ms_p99"))],
            ["the whole drain (request to the connection's close)", num(r.get("drain_total_ms"))],
            ["claim (on the other instance)", f"{num(r.get('b_claim_ms_p50'))} / –"],
            ["restore", f"{num(r.get('b_restore_ms_p50'))} / –"],
            ["a client's resume round trip", pair(r.get("b_resume_roundtrip_ms_p50"),
                                                  r.get("b_resume_roundtrip_ms_p99"))]]
    return "\n".join([
        provenance(rec), "",
        f"{r.get('sessions', '?')} idle sessions of {num(r.get('tokens_per_session'))} tokens, model "
        f"{r.get('model', '?')}; {num(r.get('record_bytes_per_1k_tokens'))} record bytes per 1,000 tokens.", "",
        table(["step", "p50 / p99, ms"], rows)])


KIND_LABELS = {"text": "text", "voice": "voice (`/v1/realtime`)", "policy": "policy, 50 Hz"}


def render_sessions_held(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows: list[list[Any]] = []
    for kind, k in r.get("kinds", {}).items():
        label = KIND_LABELS.get(kind, kind)
        if kind == "text":
            label += f", {replies(r.get('reply_every'))}"
        if kind == "policy" and r.get("policy_model"):
            label += f" ({r['policy_model']})"
        if "skipped" in k:
            rows.append([label, "skipped", "", "", str(k["skipped"])[:120], "", ""])
            continue
        rows += level_rows(k.get("levels", []), label)
        if "failed" in k:
            rows.append([label, "failed", "", "", str(k["failed"])[:120], "", ""])
    held = r.get("held_max") or {}
    return "\n".join([
        provenance(rec), "",
        f"Model {r.get('model', '?')}, {num(r.get('duration_s'), 0)} s a level, levels up to {r.get('max', '?')}:",
        "", table(LEVEL_HEAD, rows), "",
        "Held at most (`held_max`): " + ", ".join(f"{k} {'–' if v is None else v}" for k, v in held.items()) + "."])


def at_marks(samples: list[dict[str, Any]], total_s: float, marks: int = 10) -> list[dict[str, Any]]:
    """The sample nearest each of `marks` + 1 evenly spaced times from 0 to `total_s`, each once."""
    picked = [min(samples, key=lambda s: abs(s["t_s"] - total_s * i / marks)) for i in range(marks + 1)]
    return [s for i, s in enumerate(picked) if s not in picked[:i]]


def mib(x: float | None) -> str:
    """MiB of RSS to 0.1, no thousands separator (a growth of 0.9 MiB must show)."""
    return "–" if x is None else f"{x:.1f}"


def render_soak(rec: dict[str, Any]) -> str:
    r = rec["result"]
    total_s = 60 * (r.get("minutes") or 0)
    out = [provenance(rec), "",
           f"{r.get('sessions', '?')} sessions, model {r.get('model', '?')}, window {r.get('window', '?')}, "
           f"{minutes(total_s)}; warm-up the first {minutes(total_s / 5)}."]
    samples = [s for s in r.get("samples") or [] if "t_s" in s]
    if samples and total_s:
        picked = at_marks(samples, total_s)
        digits = 0 if total_s >= 600 else 1
        out += ["", table(["minute", *[num(s["t_s"] / 60, digits) for s in picked]],
                          [["server RSS (MiB)", *[mib(s.get("rss_mib")) for s in picked]],
                           ["KV pages in use", *[s.get("kv_pages_used", "–") for s in picked]]])]
    chunks, missed = r.get("chunks") or 0, r.get("missed_deadlines")
    late = f"{num(missed)} ({missed / chunks:.1%})" if chunks and missed is not None else num(missed)
    pages = r.get("pages_after_warmup")
    out += ["", table(["chunks", "replies", "append p50 / p99, ms", "acked after their 200 ms period", "errors"],
                      [[num(r.get("chunks")), num(r.get("replies")),
                        pair(r.get("append_p50_ms"), r.get("append_p99_ms"), 0), late, errors(r.get("errors"))]]), "",
            table(["RSS after warm-up → end, MiB", "growth after warm-up, MiB", "slope, MiB/hour",
                   "KV pages after warm-up", "leaked pages", "sessions open at the end"],
                  [[f"{mib(r.get('rss_warm_mib'))} → {mib(r.get('rss_end_mib'))}",
                    num(r.get("rss_growth_after_warmup_mib")), num(r.get("rss_slope_mib_per_hour")),
                    f"{pages[0]}–{pages[1]}" if pages else "–", r.get("leaked_pages", "–"),
                    r.get("sessions_open_at_end", "–")]])]
    return "\n".join(out)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "scale_out": render_scale_out, "handoff_pause": render_handoff_pause, "sessions_held": render_sessions_held,
    "soak": render_soak}
