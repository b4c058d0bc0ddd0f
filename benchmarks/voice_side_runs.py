"""The side runs of benchmarks/voice_latency.py, each the output of a kept script: the word error rates of the
speech-to-text path (benchmarks/stt_wer.py), the pipeline a user would otherwise assemble with pipecat
(benchmarks/pipecat_peer.py), the same turns on a server started with --no-speculation, and a server's replies
speculated at the first silence, by outcome (its /metrics)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def last_json(args: list[str]) -> dict[str, Any]:
    """Run a sibling script; -> the JSON object its last line prints ({"skipped": why} when it fails)."""
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=HERE.parent)
    if run.returncode != 0:
        return {"skipped": run.stderr.strip()[-500:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def wer() -> dict[str, Any]:
    """benchmarks/stt_wer.py: 36 utterances, the held-audio path against Whisper's 30 s window."""
    out = last_json([str(HERE / "stt_wer.py")])
    print(f"wer: {json.dumps(out)}", file=sys.stderr)
    return out


def pipecat(turns: int, max_tokens: int) -> dict[str, Any]:
    """benchmarks/pipecat_peer.py with the same questions, turns and reply length (needs `make llamacpp-venv`)."""
    out = last_json([str(HERE / "pipecat_peer.py"), "--turns", str(turns), "--max-tokens", str(max_tokens)])
    print(f"pipecat: {json.dumps(out)}", file=sys.stderr)
    return out


def no_speculation(model: str, ours_p50: float | None, start_server: Callable[..., Any],
                   turns: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The same turns (`turns(ws_url)`) on a second server started with --no-speculation; -> its figures and the
    ratio of its median end of speech -> first audio to `ours_p50` (the default server's)."""
    proc, port, _ = start_server(model, "--no-speculation")
    try:
        plain = turns(f"ws://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(30)
    base = plain["eos_to_first_audio_ms"]["p50"]
    print(f"no speculation: {json.dumps(plain)}", file=sys.stderr)
    return {"model": model, "silence_500": plain,
            "speculation_speedup_p50": round(base / ours_p50, 3) if ours_p50 and base else None}


def speculations(ws_url: str) -> dict[str, int]:
    """The server's replies speculated at the first silence, by outcome, over the whole run (from /metrics)."""
    with urllib.request.urlopen(ws_url.replace("ws://", "http://") + "/metrics", timeout=10) as r:  # loopback
        text = r.read().decode()
    found = re.findall(r'^streamserve_voice_speculations_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {outcome: int(float(n)) for outcome, n in found}
