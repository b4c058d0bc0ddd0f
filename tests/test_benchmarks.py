"""Every benchmark script stays runnable: a quick run of each ends with one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", [["decode.py", "--quick"], ["session_append.py", "--quick"],
                                    ["moe_cpu.py", "--quick"], ["concurrency.py", "--quick"],
                                    ["batch_invariance.py", "--quick"], ["ws_overhead.py", "--quick"],
                                    ["speculative.py", "--quick"], ["step_costs.py", "--quick"],
                                    ["gpu_check.py", "--smoke"]])
def test_benchmark_runs_and_prints_json_last(script: list[str]) -> None:
    if script[0] == "gpu_check.py":
        pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script[0]), *script[1:]], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last
