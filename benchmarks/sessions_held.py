"""Sessions held in real time on this machine, per kind, for one model: `streamserve bench` at rising levels.

    python benchmarks/sessions_held.py [--model default] [--kinds text,voice,policy] [--max 64] [--duration 20]
    python benchmarks/sessions_held.py --model smollm2-135m-instruct
    python benchmarks/sessions_held.py --quick          # level 1 of each kind for 5 s: checks the script runs

It starts `streamserve serve --model MODEL` on a free loopback port (with the voice models unless voice is not among
--kinds), and, when MODEL is no robot policy, a second server with `--model default-policy` for the policy
sessions. For each kind it runs `streamserve bench --<kind> N --duration D` at N = 1, 2, 4, 8, ... up to --max,
one kind at a time, and stops at the first level where not every session was held (a held session ran its whole
duration with no missed deadline and no error; docs/benchmarks.md, Load testing, defines each kind's deadlines).

Reported per kind: `held_max`, the largest level whose sessions were all held (0: not even one session), and per
level the sessions held, missed deadlines, errors, each measure's p50/p99 (ms), the servers' KV pages once the
sessions closed (0: none leaked) and the machine's load average (other work makes sessions late: run it on a quiet
machine). Progress goes to stderr; the last line on stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from streamserve.tools.bench.policy import probe

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("text", "voice", "policy")
START_TIMEOUT_S = 300.0  # loading a model (pulled from the package index on first use) and the voice models
BENCH_SLACK_S = 180.0  # a bench run past its duration: voice synthesis, turns answered past the end, closing


class Server:
    """`streamserve serve` as a subprocess on a free loopback port; its log goes to a temporary file."""

    def __init__(self, model: str, voice: bool, max_level: int) -> None:
        with socket.socket() as s:  # a free port now; `--port 0` would make us parse it from the log
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        room = str(max(64, 2 * max_level + 8))  # every session has its own connection, the bench a few more
        argv = [sys.executable, "-m", "streamserve", "serve", "--port", str(self.port), "--model", model,
                "--max-connections-per-ip", room, "--max-connections", str(max(256, int(room))),
                "--max-sessions-per-ip", str(max(256, int(room)))]
        if not voice:
            argv.append("--no-voice")
        self.model = model
        self.dir = tempfile.TemporaryDirectory(prefix="sessions_held-")
        self.log = Path(self.dir.name) / "serve.log"
        with self.log.open("ab") as log:  # O_APPEND: the server's writes never land where we read
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        """Until its log says `ready:`; SystemExit with the log when it exits or takes too long."""
        give_up = time.monotonic() + START_TIMEOUT_S
        while "streamserve: ready:" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > give_up:
                log = self.text()
                self.stop()
                raise SystemExit(f"`streamserve serve --model {self.model}` did not start:\n{log[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


def bench(kind: str, level: int, url: str, policy_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """One `streamserve bench` run of `level` sessions of `kind` -> its report, or {"failed": why}."""
    argv = [sys.executable, "-m", "streamserve", "bench", "--url", url, f"--{kind}", str(level),
            "--duration", str(args.duration), "--reply-every", str(args.reply_every), "--no-progress"]
    if policy_url is not None:
        argv += ["--policy-url", policy_url]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                             timeout=args.duration + BENCH_SLACK_S)
    except subprocess.TimeoutExpired:
        return {"failed": f"streamserve bench ran past {args.duration + BENCH_SLACK_S:.0f} s"}
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        return {"failed": f"streamserve bench exited {out.returncode}: {out.stderr.strip()[-1000:]}"}
    return json.loads(lines[-1])


def level_figures(report: dict[str, Any], kind: str) -> dict[str, Any]:
    """The figures of one level that the summary keeps (the full bench report is per run, not kept here)."""
    k = report["kinds"][kind]
    return {"sessions": k["sessions"], "held": k["held"], "all_held": k["held"] == k["sessions"],
            "completed": k["completed"], "missed_deadlines": k["missed_deadlines"],
            "sessions_missing_deadlines": k["sessions_missing_deadlines"], "errors": k["errors"],
            "latency_ms": {m: {"p50": v["p50"], "p99": v["p99"]} for m, v in k["latency_ms"].items()},
            "kv_pages_after_close": [s["kv_pages_used"]["after_close"] for s in report["servers"]],
            "load_avg_1m": report["load_avg_1m"], "wall_s": report["wall_s"]}


def levels_up_to(top: int) -> list[int]:
    """1, 2, 4, ... and `top` itself last when it is no power of two."""
    out = [1]
    while out[-1] * 2 <= top:
        out.append(out[-1] * 2)
    return out + ([top] if out[-1] != top else [])


def run_kind(kind: str, url: str, policy_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Levels of `kind` until one is not held (or --max) -> {held_max, levels} or {skipped} / {failed}."""
    result: dict[str, Any] = {"held_max": 0, "levels": []}
    for level in levels_up_to(args.max):
        report = bench(kind, level, url, policy_url, args)
        if "failed" in report:
            print(f"{kind} x{level}: {report['failed']}", file=sys.stderr)
            return {**result, "failed": report["failed"]}
        if "skipped" in report["kinds"][kind]:
            print(f"{kind}: skipped: {report['kinds'][kind]['skipped']}", file=sys.stderr)
            return {"skipped": report["kinds"][kind]["skipped"]}
        fig = level_figures(report, kind)
        result["levels"].append(fig)
        spreads = ", ".join(f"{m} {v['p50']}/{v['p99']}" for m, v in fig["latency_ms"].items())
        print(f"{kind} x{level}: held {fig['held']}, missed {fig['missed_deadlines']}, errors {fig['errors']}, "
              f"p50/p99 ms: {spreads}; pages after close {fig['kv_pages_after_close']}, "
              f"load {fig['load_avg_1m']['start']}-{fig['load_avg_1m']['end']}", file=sys.stderr)
        if not fig["all_held"]:
            break
        result["held_max"] = level
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="passed to `streamserve serve --model`")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from text, voice, policy")
    p.add_argument("--max", type=int, default=64, help="the highest level tried (sessions of one kind at once)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each level runs")
    p.add_argument("--reply-every", type=int, default=10,
                   help="text sessions ask for a 16-token reply every REPLY_EVERY chunks (0: appends only)")
    p.add_argument("--quick", action="store_true", help="level 1 of each kind for 5 s: checks the script runs")
    args = p.parse_args()
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    if not kinds or args.max < 1:
        p.error("--kinds names none of text, voice, policy, or --max < 1")
    if args.quick:
        args.max, args.duration = 1, 5.0
    servers = [Server(args.model, "voice" in kinds, args.max)]
    if "policy" in kinds and args.model != "default-policy":  # loaded alongside MODEL, in case MODEL is no policy
        servers.append(Server("default-policy", False, args.max))
    try:
        for server in servers:
            server.wait_ready()
        url, policy_url = servers[0].url, None
        if len(servers) == 2:
            if asyncio.run(probe(url, os.environ.get("STREAMSERVE_API_KEY"))) is None:
                servers.pop().stop()  # MODEL is a policy itself: its server takes the policy sessions
            else:
                policy_url = servers[1].url
        print(f"servers: {', '.join(f'{s.model} at {s.url}' for s in servers)}", file=sys.stderr)
        results = {kind: run_kind(kind, url, policy_url if kind == "policy" else None, args) for kind in kinds}
    finally:
        for s in servers:
            s.stop()
    print(json.dumps({"benchmark": "sessions_held", "model": args.model, "policy_model": servers[-1].model
                      if "policy" in kinds else None, "duration_s": args.duration, "max": args.max,
                      "reply_every": args.reply_every, "cpu_count": os.cpu_count(),
                      "held_max": {k: r.get("held_max") for k, r in results.items()}, "kinds": results}))


if __name__ == "__main__":
    main()
