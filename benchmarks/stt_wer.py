"""Speech to text over the audio held against Whisper's 30 s window: word error rate and time, side by side.

    python benchmarks/stt_wer.py            # the 36 utterances of benchmarks/speech_set.py
    python benchmarks/stt_wer.py --quick    # the first 6 (one per condition), for the smoke test

Each utterance is transcribed by the same Whisper base (int8, CTranslate2) three ways, interleaved:
    full     every pass padded to Whisper's 30 s window (faster-whisper's transcribe; the path before issue 32)
    held     the audio plus a second of silence, rounded up to 2 s (streamserve.media.whisper, the default)
    batched  the held path, BATCH utterances of different sessions in one call (what the STT scheduler runs)
Word error rate: word-level edit distance over the reference words, after lowercasing and stripping punctuation.
Prints a table per condition, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # speech_set.py, a sibling script
from speech_set import utterances

from streamserve.media.stt import normalize
from streamserve.media.whisper import PassRequest, Whisper
from streamserve.models.store import installed

BATCH = 4


def words_of(text: str) -> list[str]:
    return [w for w in (normalize(v) for v in text.split()) if w]


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        diagonal, row[0] = row[0], i
        for j in range(1, len(hyp) + 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ref[i - 1] != hyp[j - 1]))
    return row[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 utterances (one per condition)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    path = installed("whisper-base")
    if path is None:
        raise SystemExit("Whisper base is not in the model cache: streamserve models pull whisper-base")
    spoken = utterances(6 if args.quick else None)
    held = Whisper(path.parent, threads=args.threads)
    full = Whisper(path.parent, threads=args.threads, window="full")
    held.words(spoken[0].audio)  # warm both up (first-call allocations)
    full.words(spoken[0].audio)

    texts: dict[str, list[str]] = {"full": [], "held": []}
    seconds = {"full": 0.0, "held": 0.0, "batched": 0.0}
    for u in spoken:  # interleaved, so load on the machine hits both paths alike
        for name, model in (("full", full), ("held", held)):
            t0 = time.perf_counter()
            texts[name].append("".join(w.text for w in model.words(u.audio)))
            seconds[name] += time.perf_counter() - t0
    batched: list[str] = []
    for i in range(0, len(spoken), BATCH):
        group = spoken[i:i + BATCH]
        t0 = time.perf_counter()
        found = held.words_batch([PassRequest(u.audio) for u in group])
        seconds["batched"] += time.perf_counter() - t0
        batched += ["".join(w.text for w in words) for words in found]
    texts["batched"] = batched

    reference = [words_of(u.text) for u in spoken]
    n_words = sum(map(len, reference))
    errors = {name: [edit_distance(r, words_of(t)) for r, t in zip(reference, out, strict=True)]
              for name, out in texts.items()}
    wer = {name: round(100 * sum(e) / n_words, 2) for name, e in errors.items()}
    by_condition: dict[str, dict[str, float | int]] = {}  # per condition: its words and each path's WER (%)
    print(f"{'condition':12s} {'words':>5s} " + " ".join(f"{n + ' WER':>12s}" for n in texts))
    for c in sorted({u.condition for u in spoken}):
        idx = [i for i, u in enumerate(spoken) if u.condition == c]
        n = sum(len(reference[i]) for i in idx)
        by_condition[c] = {"words": n, **{f"wer_{k}": round(100 * sum(errors[k][i] for i in idx) / n, 1)
                                          for k in texts}}
        print(f"{c:12s} {n:5d} " + " ".join(f"{by_condition[c][f'wer_{k}']:11.1f}%" for k in texts))
    for i, u in enumerate(spoken):
        if errors["held"][i] or errors["full"][i]:
            print(f"  {u.condition:11s} {u.text!r}\n      full: {texts['full'][i].strip()!r}\n"
                  f"      held: {texts['held'][i].strip()!r}")
    audio_s = sum(u.audio.size for u in spoken) / 16000
    same_batched = sum(words_of(a) == words_of(b) for a, b in zip(texts["held"], texts["batched"], strict=True))
    print(json.dumps({
        "benchmark": "stt_wer", "utterances": len(spoken), "words": n_words, "audio_s": round(audio_s, 2),
        "threads": args.threads, "wer_full": wer["full"], "wer_held": wer["held"], "wer_batched": wer["batched"],
        "wer_held_minus_full": round(wer["held"] - wer["full"], 2),
        "ms_per_utterance_full": round(1e3 * seconds["full"] / len(spoken), 1),
        "ms_per_utterance_held": round(1e3 * seconds["held"] / len(spoken), 1),
        "ms_per_utterance_batched": round(1e3 * seconds["batched"] / len(spoken), 1),
        "speedup_held_vs_full": round(seconds["full"] / seconds["held"], 2),
        "speedup_batched_vs_held": round(seconds["held"] / seconds["batched"], 2),
        "batch": BATCH, "batched_same_words": same_batched, "conditions": by_condition,
    }))


if __name__ == "__main__":
    main()
