"""Run a benchmark script and keep its result: benchmarks/results/<name>.json, the figures docs cite.

    python benchmarks/record.py cpu_decode.py --with-llamacpp
    python benchmarks/record.py --name compile_background compile_background.py --ticks 150

The script runs as given (its stderr passes through); its last stdout line, one JSON object, is written with what
makes it reproducible: the command, the commit (and whether the work tree had changes), the date, and the machine
(CPU model, its flags of note, cores, memory, load before and after). A script that fails, or prints no JSON
last, writes nothing. One file per name: a new run replaces the old one (history stays in git).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CPU_FLAGS_OF_NOTE = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                     "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def machine() -> dict[str, Any]:
    """What the figures depend on: the CPU, its SIMD extensions, cores, memory, and the load on it."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("model name", "")
        flags = set(fields.get("flags", "").split())
        info["cpu_flags"] = [f for f in CPU_FLAGS_OF_NOTE if f in flags]
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:  # not Linux: the platform line says what it is
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", help="the result's name (default: the script's, without .py)")
    p.add_argument("script", help="a script in benchmarks/")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args()
    name = a.name or Path(a.script).stem
    command = ["python", f"benchmarks/{Path(a.script).name}", *a.args]
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / Path(a.script).name), *a.args], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
    if done.returncode:
        print(f"record: {a.script} failed ({done.returncode}); nothing written", file=sys.stderr)
        return done.returncode
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"record: {a.script} printed no JSON line last; nothing written", file=sys.stderr)
        return 1
    record = {"name": name, "command": " ".join(command), "commit": git("rev-parse", "--short", "HEAD"),
              "work_tree_changed": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                            ":(exclude)benchmarks/results")),  # other results are no code
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "seconds": round(time.perf_counter() - t0, 1),
              "machine": {**machine(), "load_before": load_before,
                          "load_after": [round(x, 2) for x in os.getloadavg()]},
              "result": result}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
