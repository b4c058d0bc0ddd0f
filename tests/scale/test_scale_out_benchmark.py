"""benchmarks/scale_out.py stays runnable: its quick run (one instance directly and two behind nginx, one text session
each for 5 s; then a hand-off of two sessions) ends with one JSON line that has every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scale_support import needs_nginx

ROOT = Path(__file__).resolve().parent.parent.parent


@needs_nginx
@pytest.mark.slow
def test_the_scale_out_benchmark_runs_and_prints_json_last() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_out.py"), "--quick"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["benchmark"] == "scale_out" and set(last["setups"]) == {"direct", "nginx"}
    for name in ("direct", "nginx"):  # both setups ran the level, through the bench
        assert [lv["sessions"] for lv in last["setups"][name]["levels"]] == [1]
    assert {"held_direct_one_instance", "held_nginx_two_instances", "ratio"} <= set(last)
    handoff = last["handoff"]
    assert handoff["drain_status"] == 202 and handoff["drained_instance_exit"] == 0, handoff
    assert len(handoff["pauses_ms"]) == 2 and last["handoff_pause_ms"]["p99"] == max(handoff["pauses_ms"])
    assert last["snapshot_bytes_per_1k_tokens"] > 0
