"""Scale-out on this machine: text sessions held in real time by one instance directly, and by two instances behind
nginx (`streamserve proxy-config`), measured side by side in one run.

    python benchmarks/scale_out.py [--model default] [--levels 1,2,3,4,6,8,12,16] [--duration 20]
    python benchmarks/scale_out.py --quick          # level 1 of each setup for 5 s: checks the script runs

It starts three `streamserve serve --model MODEL --no-voice` on free loopback ports (one alone, two behind Debian's
nginx, `apt-get install nginx-light`, run from a `proxy-config --standalone` file under a temporary prefix) and, at
each level N of --levels, runs `streamserve bench --text N` once against the lone instance and once through nginx
(each text session is its own SDK client with its own random affinity key, so the sessions spread over the two
instances), until a level is not held by either (a held session ran its whole duration with no missed deadline and no
error; docs/benchmarks.md, Load testing). The setups take turns, so both see the same machine.

`ratio` is held_max through nginx over held_max direct. On a machine whose cores one instance already uses (2 cores:
the engine thread and the event loop), two instances share the same cores and the ratio is about 1: it then measures
what nginx and a second process cost, not what a second machine or GPU would add (each instance serves one
accelerator; on N machines the ratio is what the proxy lets N instances keep).

The hand-off figures (pause per session from `POST /admin/drain` to its resume on the other instance, p50/p99, and
snapshot bytes per 1,000 tokens) have their place in the JSON; they are null until measured (see `handoff`).
Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script's server and bench runner
from sessions_held import Server, bench, level_figures

from streamserve.tools.nginx import STANDALONE_DIRS, ProxyOptions, render

NGINX_START_S = 30.0


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="passed to `streamserve serve --model`")
    p.add_argument("--levels", default="1,2,3,4,6,8,12,16", help="text sessions at once, rising, comma-separated")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each level runs")
    p.add_argument("--reply-every", type=int, default=10,
                   help="text sessions ask for a 16-token reply every REPLY_EVERY chunks (0: appends only)")
    p.add_argument("--quick", action="store_true", help="level 1 of each setup for 5 s: checks the script runs")
    args = p.parse_args()
    try:
        levels = sorted({int(x) for x in args.levels.split(",") if x.strip()})
    except ValueError:
        p.error("--levels: integers, comma-separated")
    if not levels or levels[0] < 1:
        p.error("--levels: integers >= 1")
    if args.quick:
        levels, args.duration = [1], 5.0
    top = levels[-1]
    servers = [Server(args.model, False, top) for _ in range(3)]  # [direct, behind nginx, behind nginx]
    nginx: Nginx | None = None
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
        for level in levels:  # the setups take turns at each level, until neither holds one
            for name in ("direct", "nginx"):
                if name not in going:
                    continue
                fig = run_level(level, urls[name], args, name)
                setups[name]["levels"].append(fig)
                if fig["all_held"]:
                    setups[name]["held_max"] = level
                else:
                    going.discard(name)
            if not going:
                break
    finally:
        if nginx is not None:
            nginx.stop()
        for s in servers:
            s.stop()
    direct, proxied = setups["direct"]["held_max"], setups["nginx"]["held_max"]
    print(f"held: direct {direct}, two instances behind nginx {proxied}", file=sys.stderr)
    print(__import__("json").dumps({
        "benchmark": "scale_out", "model": args.model, "kind": "text", "duration_s": args.duration,
        "reply_every": args.reply_every, "levels": levels, "cpu_count": os.cpu_count(),
        "held_direct_one_instance": direct, "held_nginx_two_instances": proxied,
        "ratio": round(proxied / direct, 2) if direct else None,
        "ratio_note": f"two instances share this machine's {os.cpu_count()} cores with the one: ~1 expected where "
                      "one instance already uses every core (the proxy's and a second process's cost, not a second "
                      "accelerator's gain)",
        "handoff_pause_ms": {"p50": None, "p99": None}, "snapshot_bytes_per_1k_tokens": None,
        "handoff": "not measured by this run (the drain and hand-off are measured once they are in: see docs/scale.md)",
        "setups": setups}))


if __name__ == "__main__":
    main()
