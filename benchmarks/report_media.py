"""Renderers of docs/benchmarks.md's voice sections: voice turns over /v1/realtime (benchmarks/voice_latency.py),
speech to text over the audio held (benchmarks/stt_wer.py) and voice over WebRTC (benchmarks/webrtc_latency.py).
Each takes a kept result (benchmarks/results/NAME.json) and returns the Markdown between `<!-- results:NAME -->` and
`<!-- /results:NAME -->`; parts a run may leave out (a skipped peer, `--no-wer`, a model not pulled) are skipped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from report_format import num, pair, provenance, ratio, table, yes

# voice_latency.py's turn detection conditions and its turn's stages, in the order the doc shows them
CONDITIONS = (("silence_500", "server_vad, 500 ms"), ("silence_200", "server_vad, 200 ms"),
              ("semantic_auto", "semantic_vad, auto"))
STAGES = (("vad_hangover", "VAD hangover"), ("transcript_final", "transcript final"), ("ttft", "first token"),
          ("first_tts_chunk", "first TTS chunk"))


def spread(d: dict[str, Any] | None, digits: int = 0) -> str:
    """A `{"p50", "p99"}` dict as `p50 / p99`; dashes when it is missing."""
    d = d or {}
    return pair(d.get("p50"), d.get("p99"), digits)


def times(a: float | None, b: float | None) -> str:
    """a ÷ b in bold, or a dash when either is missing or b is 0."""
    return ratio(a / b) if a and b else "–"


def given(part: Any) -> bool:
    """A side run's dict that ran: present, and neither skipped nor failed."""
    return isinstance(part, dict) and bool(part) and "skipped" not in part and "failed" not in part


def wer_brief(w: dict[str, Any]) -> str:
    """stt_wer.py's JSON (voice_latency.py's `wer`) in a line."""
    return (f"{num(w.get('wer_held'), 2)}% over the audio held against {num(w.get('wer_full'), 2)}% with Whisper's "
            f"30 s window ({w.get('utterances', '?')} utterances); {num(w.get('ms_per_utterance_held'))} against "
            f"{num(w.get('ms_per_utterance_full'))} ms an utterance ({num(w.get('ms_per_utterance_batched'))} in "
            f"batches of {w.get('batch', '?')})")


def rtf_brief(m: dict[str, Any]) -> str:
    """media_rtf.py's real-time factors (compute time ÷ audio time) in a line."""
    c = m.get("compute_s", {})

    def one(key: str, label: str, audio: str = "") -> str:
        ms = f" ({num(c[key] * 1e3, 0)} ms{audio})" if key in c else ""
        return f"{label} {m.get(key, '–')}{ms}"

    sentence = f" for a {m['piper_sentence_audio_s']} s sentence" if "piper_sentence_audio_s" in m else ""
    threads = m.get("threads", "?")
    return (f"{threads} thread{'' if threads == 1 else 's'} each: {one('whisper_2s', 'Whisper over 2 s')}, "
            f"{one('whisper_5s', 'over 5 s')}; {one('vad_10s', 'Silero VAD over 10 s')}; "
            f"{one('piper_sentence', 'Piper', sentence)}")


def condition_row(label: str, s: dict[str, Any]) -> list[str]:
    return [label, s.get("turns_answered", "–"), *[spread(s.get(f"{k}_ms")) for k, _ in STAGES],
            f"**{num((s.get('eos_to_first_audio_ms') or {}).get('p50'), 0)}** / "
            f"{num((s.get('eos_to_first_audio_ms') or {}).get('p99'), 0)}"]


def render_voice_latency(rec: dict[str, Any]) -> str:
    r = rec["result"]
    out = [provenance(rec), "",
           f"{r.get('turns', '?')} turns per condition, replies of {r.get('max_output_tokens', '?')} tokens at most; "
           "ms, p50 / p99 (each stage after the one before; the last column from the end of speech)."]
    nospec = r.get("no_speculation") if given(r.get("no_speculation")) else None
    head = ["turn detection", "turns answered", *[label for _, label in STAGES], "end of speech → first audio"]
    for model, m in r.get("models", {}).items():
        if not given(m):
            out += ["", f"**{model}**: skipped ({m.get('skipped', m.get('failed', 'no figures'))})."]
            continue
        rows = [condition_row(label, m[k]) for k, label in CONDITIONS if k in m]
        if nospec and nospec.get("model") == model and "silence_500" in nospec:
            rows.append(condition_row("server_vad, 500 ms, `--no-speculation`", nospec["silence_500"]))
        out += ["", f"**{model}**", "", table(head, rows)]
    peer = r.get("pipecat")
    if given(peer):
        out += ["", f"The pipecat peer (pipecat {peer.get('pipecat', '?')}, {peer.get('silence_s', '?')} s of "
                    f"silence, {peer.get('turns_answered', '?')} turns answered), ms after the end of speech:", "",
                table(["VAD stop p50", "transcript p50", "turn end p50", "first token p50", "first audio p50 / p99"],
                      [[num(peer.get(f"{k}_ms_p50"), 0) for k in ("vad_stop", "transcript", "turn_end", "first_token")]
                       + [spread(peer.get("eos_to_first_audio_ms"))]])]
    model = r.get("concurrency_model")
    levels = r.get("models", {}).get(model, {}).get("concurrency") if model else None
    if levels:
        rows = [[c.get("sessions"), c.get("turns_answered", "–"), num(c.get("eos_to_first_audio_p50_ms"), 0),
                 *[num((c.get("stages_p50_ms") or {}).get(k), 0) for k, _ in STAGES], spread(c.get("stop_lag_ms")),
                 yes(bool(c.get("kept_up")))] for c in levels]
        out += ["", f"Sessions at once ({model}, server_vad {r.get('concurrency_silence_ms', 500)} ms, "
                    f"{r.get('session_turns', '?')} turns each; p50 of each stage, ms):", "",
                table(["sessions", "turns answered", "end of speech → first audio", *[label for _, label in STAGES],
                       "VAD stop lag p50 / p99", "kept up"], rows)]
    rows = facts(r)
    return "\n".join(out + (["", table(["figure", "value"], rows)] if rows else []))


def facts(r: dict[str, Any]) -> list[list[str]]:
    """voice_latency.py's single figures: the ratios against the peers, the side runs, the hangover's parts."""
    rows: list[list[str]] = []
    models = r.get("models", {})
    peer, ours = r.get("pipecat"), models.get("smollm2-135m-instruct", {}).get("silence_500", {})
    if given(peer) and r.get("pipecat_over_streamserve_p50"):
        rows.append(["pipecat ÷ streamserve, end of speech → first audio p50 (`pipecat_over_streamserve_p50`)",
                     f"{ratio(r['pipecat_over_streamserve_p50'])} "
                     f"({num((peer.get('eos_to_first_audio_ms') or {}).get('p50'), 0)}"
                     f" / {num((ours.get('eos_to_first_audio_ms') or {}).get('p50'), 0)} ms)"])
    nospec = r.get("no_speculation")
    if given(nospec) and nospec.get("speculation_speedup_p50"):
        first = models.get(nospec.get("model"), {}).get("silence_500", {})
        rows.append([f"`--no-speculation` ÷ speculation at p50, server_vad 500 ms ({nospec.get('model')})",
                     f"{ratio(nospec['speculation_speedup_p50'])} "
                     f"({num(((nospec.get('silence_500') or {}).get('eos_to_first_audio_ms') or {}).get('p50'), 0)} / "
                     f"{num((first.get('eos_to_first_audio_ms') or {}).get('p50'), 0)} ms)"])
    for model, m in models.items():
        if given(m) and m.get("speculations"):
            rows.append([f"replies speculated at the first silence, by outcome ({model}, `speculations`)",
                         ", ".join(f"{k} {v}" for k, v in m["speculations"].items())])
        if given(m) and "sessions_at_real_time" in m:
            rows.append([f"most sessions kept up ({model}, `sessions_at_real_time`)", str(m["sessions_at_real_time"])])
        s = m.get("silence_500") if given(m) else None
        if s:
            rows.append([f"server_vad 500 ms ({model}): speech_stopped's audio end after the end of speech; "
                         "VAD stop lag (p50 / p99)",
                         f"{spread(s.get('audio_end_after_eos_ms'))} ms; {spread(s.get('stop_lag_ms'))} ms"])
    if given(r.get("wer")):
        rows.append(["word error rate (`wer`: benchmarks/stt_wer.py)", wer_brief(r["wer"])])
    if given(r.get("media_rtf")):
        rows.append(["media real-time factors (`media_rtf`)", rtf_brief(r["media_rtf"])])
    return rows


def speedup(r: dict[str, Any], key: str) -> str:
    return ratio(r[key]) if r.get(key) is not None else "–"


def render_stt_wer(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rows = [["30 s window", f"{num(r.get('wer_full'), 2)}%", num(r.get("ms_per_utterance_full")), ""],
            ["audio held", f"{num(r.get('wer_held'), 2)}%", num(r.get("ms_per_utterance_held")),
             f"{speedup(r, 'speedup_held_vs_full')} over the 30 s window"],
            [f"audio held, batches of {r.get('batch', '?')}", f"{num(r.get('wer_batched'), 2)}%",
             num(r.get("ms_per_utterance_batched")),
             f"{speedup(r, 'speedup_batched_vs_held')} over the held path"]]
    diff = r.get("wer_held_minus_full")
    points = "–" if diff is None else f"{diff:+.2f}".replace("-", "−")
    return "\n".join([
        provenance(rec), "",
        f"{r.get('utterances', '?')} utterances, {r.get('words', '?')} words, {num(r.get('audio_s'))} s of audio, "
        f"{r.get('threads', '?')} threads.", "",
        table(["path", "word error rate", "ms per utterance", "speed-up"], rows), "",
        f"Held − 30 s window: {points} points of word error rate; the batched path gave the held path's words in "
        f"{r.get('batched_same_words', '?')} of {r.get('utterances', '?')} utterances.",
        *(["", table(["condition", "words", "30 s window", "held", "held, batched"],
                     [[c, v["words"], f"{v['wer_full']:.1f}%", f"{v['wer_held']:.1f}%", f"{v['wer_batched']:.1f}%"]
                      for c, v in r["conditions"].items()])] if r.get("conditions") else [])])


def render_webrtc_latency(rec: dict[str, Any]) -> str:
    r = rec["result"]
    rtc, ws = r.get("webrtc_first_audio_ms") or {}, r.get("websocket_first_audio_ms") or {}
    out = [provenance(rec), "",
           f"{r.get('turns', '?')} turns per transport, `max_output_tokens` {r.get('max_tokens', '?')}; ms, "
           "p50 / p99 from the end of speech.", "",
           table(["", "WebRTC (decoded at the client)", "WebSocket (`/v1/realtime`)", "WebRTC ÷ WebSocket at p50"],
                 [["first reply audio", spread(rtc), spread(ws), times(rtc.get("p50"), ws.get("p50"))],
                  ["speech_stopped", spread(r.get("webrtc_speech_stopped_after_eos_ms")), "", ""]]), "",
           f"Server CPU per call: {num(r.get('cpu_per_call_idle'), 3)} cores idle, "
           f"{num(r.get('cpu_per_call_turns'), 3)} over its turns."]
    levels = r.get("capacity")
    if levels:
        rows = [[c.get("calls"), yes(bool(c.get("kept_up"))), c.get("answered", "–"),
                 num(c.get("first_audio_ms_p50"), 0), num(c.get("stop_lag_ms_max"), 0),
                 num(c.get("reply_track_rate_min"), 3)] for c in levels]
        out += ["", table(["calls at once", "kept up", "answered", "first reply audio p50, ms",
                           "speech_stopped after the end of speech, max ms", "reply track rate, least (of 50 fps)"],
                          rows), "",
                f"Most calls at once kept up (`calls_kept_up_max`): {r.get('calls_kept_up_max', '–')}."]
    return "\n".join(out)


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "voice_latency": render_voice_latency, "stt_wer": render_stt_wer, "webrtc_latency": render_webrtc_latency}
