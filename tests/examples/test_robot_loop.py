"""examples/robot_loop.py against a real `streamserve serve --model default-policy` (a subprocess on a loopback
port): in lockstep the trained policy reaches its targets through the native SDK and through openpi's unchanged
client (the same episodes: lockstep is deterministic), and in real time with a deadline no reply can meet every
reply is stale and the arm still moves on the rows stale replies carry (the last chunk's still ahead)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamserve.robot import arm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "robot_loop.py"
OPENPI_PYTHON = Path(os.environ.get("OPENPI_PYTHON", ROOT / "build" / "openpi-venv" / "bin" / "python"))
EPISODES = 10


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if k != "STREAMSERVE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--device", "cpu",
                             "--model", "default-policy", "--offline", "--no-voice", "--no-vision",
                             "--min-deadline-ms", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    assert proc.stderr is not None
    port, lines = None, collections.deque(maxlen=100)
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "ready:" in line or "failed" in line:
            break
    try:
        assert port is not None and any("ready:" in x for x in lines), "".join(lines)
        threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()  # keep the pipe drained
        yield f"ws://127.0.0.1:{port}/v1/policy"
    finally:
        proc.terminate()
        proc.wait(30)


def run(python: str | Path, url: str, *args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([str(python), str(EXAMPLE), "--url", url, *args], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lockstep_episodes_reach_their_targets_through_the_sdk_and_openpi_client(url: str) -> None:
    native = run(sys.executable, url, "--lockstep", "--episodes", str(EPISODES))
    expert = arm.success_rate(list(arm.EVAL_SEEDS[:EPISODES]), lambda: arm.ExpertPolicy(4), replan_every=2)
    print(f"\npolicy {native['success_rate']:.0%} vs the scripted expert {expert:.0%} on {EPISODES} episodes")
    assert native["episodes"] == EPISODES and native["success_rate"] >= 0.9, native
    assert native["stale"] == 0 and native["held_ticks"] == 0  # lockstep: every chunk is fresh
    if not OPENPI_PYTHON.exists():
        pytest.skip("openpi-client's environment is missing: run `make openpi-venv`")
    # openpi's client in its own environment (NumPy 1.x); the example and the arm come from this checkout
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'clients' / 'python'}"}
    openpi = run(OPENPI_PYTHON, url, "--client", "openpi", "--lockstep", "--episodes", "4", env=env)
    first4 = run(sys.executable, url, "--lockstep", "--episodes", "4")
    assert {k: openpi[k] for k in ("success_rate", "ticks", "requests")} == \
        {k: first4[k] for k in ("success_rate", "ticks", "requests")}


def test_a_robot_whose_replies_are_all_stale_executes_their_rows(url: str) -> None:
    # real time, a 0 ms deadline (the server's floor is 0 here): every reply comes back stale at once, but each late
    # chunk is still decoded and the next stale reply carries its rows still ahead: the arm executes them
    out = run(sys.executable, url, "--episodes", "1", "--deadline-ms", "0")
    assert out["requests"] > 0 and out["stale"] == out["requests"] and out["fresh_replies"] == 0, out
    assert out["held_ticks"] < out["ticks"] / 2, out  # it moves on stale rows instead of holding still
