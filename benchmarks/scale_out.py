"""Scale-out on this machine: text sessions held in real time by one instance directly, and by two instances behind
nginx (`streamserve proxy-config`), measured side by side in one run.

    python benchmarks/scale_out.py [--model default] [--levels 1,2,3,4,6,8,12,16] [--duration 20]
    python benchmarks/scale_out.py --quick          # level 1 of each setup for 5 s: checks the script runs

It starts three `streamserve serve --model MODEL --no-voice` on free loopback ports (one alone, two behind Debian's
nginx, `apt-get install nginx-light`, run from a `proxy-config --standalone` file under a temporary prefix) and, at
each level N of --levels, runs `streamserve bench --text N` against the lone instance and through nginx (each text
session is its own SDK client with its own random affinity key, so the sessions spread over the two instances), up
to --tries times each until it is held, and goes on until a level is held by neither (a held session ran its whole
duration with no missed deadline and no error; docs/benchmarks.md, Load testing). The setups take turns, so both see
the same machine.

`ratio` is held_max through nginx over held_max direct. On a machine whose cores one instance already uses (2 cores:
the engine thread and the event loop), two instances share the same cores and the ratio is about 1: it then measures
what nginx and a second process cost, not what a second machine or GPU would add (each instance serves one
accelerator; on N machines the ratio is what the proxy lets N instances keep).

Then the hand-off (docs/scale.md, Hand-off): the two instances behind nginx share a `--snapshot-store`. --handoff N
SDK clients, each with its own affinity key and one session (--handoff-tokens tokens appended, then a 16-token greedy
reply) on the first instance, plus one more session whose client does not reconnect (its record stays in the store,
to be weighed), when `POST /admin/drain` drains that instance. Each client then appends a chunk as soon as it has
reconnected; `handoff_pause_ms` (p50/p99) is the time from the drain request to that chunk's ack from the other
instance (the drain's wait for running work, the snapshots, the reconnect through nginx, the claim and restore, and
one append). `snapshot_bytes_per_1k_tokens` is the weighed record's size per 1,000 tokens of its session.
With --sglang-python PY (SGLang's Python: tests/support/sglang/install.sh), the run ends with the SGLang backend
against the engine on one tiny checkpoint (benchmarks/sglang_backend.py, run as a child: per-chunk append latency
and the 8 x 150-turn session workload), its figures under `sglang_vs_engine`.
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script's server and bench runner
from sessions_held import Server, bench, level_figures

import streamserve_client as sc
from streamserve.tools.bench.record import percentile
from streamserve.tools.nginx import STANDALONE_DIRS, ProxyOptions, render

NGINX_START_S = 30.0
HANDOFF_WAIT_S = 120.0  # a drain's end (every record written, the instance gone), and each client's resume
KJV = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
       "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")


class Instance(Server):
    """sessions_held's server (its readiness wait, log and stop) started with flags of our own: `--max-reply-tokens
    1000 + index` (its hello tells a client which instance it reached; the bench's replies are far shorter) and,
    behind nginx, a shared snapshot store."""

    def __init__(self, model: str, max_level: int, index: int, store: str | None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        room = str(max(64, 2 * max_level + 8))  # every session has its own connection, the bench a few more
        argv = [sys.executable, "-m", "streamserve", "serve", "--port", str(self.port), "--model", model, "--no-voice",
                "--max-connections-per-ip", room, "--max-sessions-per-ip", str(max(256, int(room))),
                "--max-reply-tokens", str(1000 + index)] + (["--snapshot-store", store] if store else [])
        self.model, self.index = model, index
        self.dir = tempfile.TemporaryDirectory(prefix="scale_out-")
        self.log = Path(self.dir.name) / "serve.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Nginx:
    """Debian's nginx in the foreground from a standalone proxy-config file under a temporary prefix."""

    def __init__(self, upstreams: tuple[str, ...]) -> None:
        binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
        if binary is None:
            raise SystemExit("needs Debian's nginx: apt-get install nginx-light")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.TemporaryDirectory(prefix="scale_out-nginx-")
        prefix = Path(self.dir.name)
        for name in STANDALONE_DIRS:
            (prefix / name).mkdir()
        (prefix / "nginx.conf").write_text(render(ProxyOptions(upstreams, listen=f"127.0.0.1:{self.port}",
                                                               standalone=True)))
        directives = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")  # root: workers stay root
        self.proc = subprocess.Popen([binary, "-p", str(prefix), "-c", "nginx.conf", "-g", directives],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        give_up = time.monotonic() + NGINX_START_S
        while True:
            if self.proc.poll() is not None or time.monotonic() > give_up:
                log = (prefix / "logs" / "error.log").read_text() if (prefix / "logs" / "error.log").exists() else ""
                self.stop()
                raise SystemExit(f"nginx did not start:\n{log[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


def run_level(level: int, url: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    report = bench("text", level, url, None, args)
    if "failed" in report:
        print(f"{label} x{level}: {report['failed']}", file=sys.stderr)
        return {"sessions": level, "held": 0, "all_held": False, "failed": report["failed"]}
    fig = level_figures(report, "text")
    fig.pop("kv_pages_after_close")  # through nginx the bench samples one instance of the two: not comparable
    spreads = ", ".join(f"{m} {v['p50']}/{v['p99']}" for m, v in fig["latency_ms"].items())
    print(f"{label} x{level}: held {fig['held']}, missed {fig['missed_deadlines']}, errors {fig['errors']}, "
          f"p50/p99 ms: {spreads}, load {fig['load_avg_1m']['start']}-{fig['load_avg_1m']['end']}", file=sys.stderr)
    return fig


def which(hello: dict[str, Any]) -> int:
    """The index of the instance that sent this hello (Instance: max_reply_tokens 1000 + index)."""
    return int(hello["limits"]["max_reply_tokens"]) - 1000


def post_drain(address: str) -> int:
    """POST /admin/drain straight to the instance (loopback, no proxy in between: allowed without an API key)."""
    req = urllib.request.Request(f"http://{address}/admin/drain", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return int(r.status)


async def fill(session: Any, tokens: int) -> int:
    """Appends of KJV text until the session holds `tokens`, then a 16-token greedy reply; -> the tokens it holds."""
    held = 0
    while held < tokens:
        held += (await session.append(text=KJV)).tokens
    return held + len([t async for d in session.respond(max_tokens=16, temperature=0.0) for t in d.token_ids])


async def handoff(url: str, target: Instance, store: Path, sessions: int, tokens: int) -> dict[str, Any]:
    """Drain `target` with `sessions` conversations on it (and one more, to weigh its record); see the docstring."""
    clients: list[sc.Client] = []
    try:
        for _ in range(8 * (sessions + 1)):  # new keys until enough land on the target
            weigh = len(clients) == sessions  # the last does not reconnect: its record stays in the store
            client = sc.Client(url, reconnect=not weigh)
            await client.connect()
            if which(client.hello) == target.index:
                clients.append(client)
                if len(clients) == sessions + 1:
                    break
            else:
                await client.close()
        else:
            return {"failed": f"fewer than {sessions + 1} of {8 * (sessions + 1)} keys landed on the instance"}
        opened = [await c.open_session() for c in clients]
        held = await asyncio.gather(*(fill(s, tokens) for s in opened))
        before = [c.hello for c in clients]
        t0 = time.perf_counter()
        status = await asyncio.to_thread(post_drain, target.address)

        async def resumed(i: int) -> float:
            while clients[i].hello is before[i]:  # until the client has reconnected (a new connection's hello)
                await asyncio.sleep(0.001)
            await opened[i].append(text=" And")  # acked once resumed there
            if which(clients[i].hello) == target.index:
                raise SystemExit("a client reconnected to the drained instance")
            return (time.perf_counter() - t0) * 1e3

        pauses = await asyncio.wait_for(asyncio.gather(*(resumed(i) for i in range(sessions))), HANDOFF_WAIT_S)
        code = await asyncio.to_thread(target.proc.wait, HANDOFF_WAIT_S)
        record = store / f"{opened[-1].id}.rec"
        size = record.stat().st_size if record.exists() else None
        return {"sessions": sessions, "tokens_per_session": sorted(held), "drain_status": status,
                "drained_instance_exit": code, "pauses_ms": [round(x, 1) for x in sorted(pauses)],
                "pause_p50_ms": round(percentile(pauses, 0.5) or 0.0, 1),
                "pause_p99_ms": round(percentile(pauses, 0.99) or 0.0, 1), "record_bytes": size,
                "record_tokens": held[-1],
                "bytes_per_1k_tokens": None if size is None else round(size * 1000 / held[-1])}
    finally:
        for c in clients:
            await c.close()


def sglang_vs_engine(python: str, sessions: int, turns: int) -> dict[str, Any]:
    """benchmarks/sglang_backend.py as a child (it starts its own SGLang); -> its JSON line."""
    script = Path(__file__).with_name("sglang_backend.py")
    out = subprocess.run([sys.executable, str(script), "--sglang-python", python, "--sessions", str(sessions),
                          "--turns", str(turns)], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="passed to `streamserve serve --model`")
    p.add_argument("--levels", default="1,2,3,4,6,8,12,16", help="text sessions at once, rising, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each level runs")
    p.add_argument("--reply-every", type=int, default=10,
                   help="text sessions ask for a 16-token reply every REPLY_EVERY chunks (0: appends only)")
    p.add_argument("--tries", type=int, default=2,
                   help="runs of a level a setup may take to hold it (the machine's other work makes sessions late "
                        "now and then; both setups get the same tries)")
    p.add_argument("--handoff", type=int, default=8, help="conversations on the drained instance (0: no hand-off)")
    p.add_argument("--handoff-tokens", type=int, default=500, help="tokens each of them holds when it drains")
    p.add_argument("--quick", action="store_true", help="level 1 of each setup for 5 s, a hand-off of 2 sessions of "
                                                        "100 tokens: checks the script runs")
    p.add_argument("--sglang-python", help="also the SGLang backend vs the engine (benchmarks/sglang_backend.py)")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run stops its servers and nginx too
    try:
        levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    except ValueError:
        p.error("--levels: integers, comma-separated")
    if not levels or levels[0] < 1:
        p.error("--levels: integers >= 1")
    if args.quick:
        levels, args.duration, args.handoff, args.handoff_tokens, args.tries = [1], 5.0, 2, 100, 1
    top = levels[-1]
    store = tempfile.TemporaryDirectory(prefix="scale_out-store-")
    # [direct, behind nginx, behind nginx]; the two behind nginx share the snapshot store
    servers = [Instance(args.model, top, i, None if i == 0 else store.name) for i in range(3)]
    nginx: Nginx | None = None
    handed: dict[str, Any] = {"skipped": "--handoff 0"}
    setups: dict[str, dict[str, Any]] = {"direct": {"held_max": 0, "levels": []},
                                         "nginx": {"held_max": 0, "levels": []}}
    try:
        for s in servers:
            s.wait_ready()
        nginx = Nginx(tuple(f"127.0.0.1:{s.port}" for s in servers[1:]))
        urls = {"direct": servers[0].url, "nginx": nginx.url}
        print(f"direct: {urls['direct']}; nginx {urls['nginx']} -> {servers[1].url}, {servers[2].url}",
              file=sys.stderr)
        going = {"direct", "nginx"}
        for level in levels:  # the setups take turns at each level (and each try), until neither holds one
            for _ in range(args.tries):
                for name in [n for n in ("direct", "nginx") if n in going and setups[n]["held_max"] < level]:
                    fig = run_level(level, urls[name], args, name)
                    setups[name]["levels"].append(fig)
                    if fig["all_held"]:
                        setups[name]["held_max"] = level
            going = {n for n in going if setups[n]["held_max"] == level}
            if not going:
                break
        if args.handoff > 0:
            handed = asyncio.run(handoff(nginx.url, servers[1], Path(store.name), args.handoff, args.handoff_tokens))
            print(f"hand-off: {handed}", file=sys.stderr)
    finally:
        if nginx is not None:
            nginx.stop()
        for s in servers:
            s.stop()
        store.cleanup()
    sglang: dict[str, Any] = {"skipped": "no --sglang-python"}
    if args.sglang_python:
        sglang = sglang_vs_engine(args.sglang_python, 2 if args.quick else 8, 10 if args.quick else 150)
    direct, proxied = setups["direct"]["held_max"], setups["nginx"]["held_max"]
    print(f"held: direct {direct}, two instances behind nginx {proxied}", file=sys.stderr)
    print(json.dumps({
        "benchmark": "scale_out", "model": args.model, "kind": "text", "duration_s": args.duration,
        "reply_every": args.reply_every, "levels": levels, "tries": args.tries, "cpu_count": os.cpu_count(),
        "held_direct_one_instance": direct, "held_nginx_two_instances": proxied,
        "ratio": round(proxied / direct, 2) if direct else None,
        "ratio_note": f"two instances share this machine's {os.cpu_count()} cores with the one: ~1 expected where "
                      "one instance already uses every core (the proxy's and a second process's cost, not a second "
                      "accelerator's gain)",
        "handoff_pause_ms": {"p50": handed.get("pause_p50_ms"), "p99": handed.get("pause_p99_ms")},
        "snapshot_bytes_per_1k_tokens": handed.get("bytes_per_1k_tokens"), "handoff": handed, "setups": setups,
        "sglang_vs_engine": sglang}))


if __name__ == "__main__":
    main()
