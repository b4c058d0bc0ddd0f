"""The real, unchanged openpi-client (its own virtual environment: `make openpi-venv`) against /v1/policy's own port,
with an API key (openpi's `Authorization: Api-Key KEY`), through several ticks and an error."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import json_of_subprocess
from policy_fixture import POLICY, POLICY_CONFIG, freed, loader
from serving import serve

ROOT = Path(__file__).resolve().parents[3]
OPENPI_PYTHON = Path(os.environ.get("OPENPI_PYTHON", ROOT / "build" / "openpi-venv" / "bin" / "python"))
DRIVER = Path(__file__).with_name("openpi_driver.py")
CLIENT_DRIVER = Path(__file__).with_name("client_driver.py")

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not OPENPI_PYTHON.exists(), reason="openpi-client's environment is missing: run "
                                 "`make openpi-venv` (or set OPENPI_PYTHON)")]


async def test_openpi_client_drives_the_policy_port(policy_checkpoint: Path) -> None:
    async with serve(replace(POLICY_CONFIG, api_key="robot-key"), loader(policy_checkpoint)) as srv:
        port = srv.server.policy.port
        out = await run_driver(DRIVER, "127.0.0.1", str(port), "robot-key")
        await freed(srv)  # the connection closed with 1011 after the error: its episode is freed
    h, d = POLICY["action_horizon"], POLICY["action_dims"]
    assert out["metadata"]["action_horizon"] == h and out["metadata"]["state_key"] == "observation/state"
    assert [t["shape"] for t in out["ticks"]] == [[h, d]] * 5 and {t["dtype"] for t in out["ticks"]} == {"float32"}
    assert out["ticks"][0]["timing"] == ["infer_ms"]
    assert all(t["timing"] == ["infer_ms", "prev_total_ms"] and t["stale"] is False for t in out["ticks"][1:])
    assert all(t["policy_timing"]["infer_ms"] > 0 and 1 <= t["policy_timing"]["forwards"] <= h * d
               for t in out["ticks"])
    assert np.isfinite(np.array([t["actions"] for t in out["ticks"]])).all()
    assert out["broker"] == [[d]] * (h + 1)  # openpi's chunk broker steps through our chunks
    assert out["error"] is not None and "invalid_observation" in out["error"] and "NaN" in out["error"]


async def run_driver(script: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run a driver script with openpi-client's Python; -> the JSON line it prints last."""
    return await json_of_subprocess(str(OPENPI_PYTHON), str(script), *args, env=env)


async def test_policy_client_under_numpy_1(policy_checkpoint: Path) -> None:
    """streamserve_client.policy in the same NumPy-1.26 environment (the test environment has NumPy 2)."""
    async with serve(POLICY_CONFIG, loader(policy_checkpoint)) as srv:
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT / "clients" / "python")}
        out = await run_driver(CLIENT_DRIVER, srv.url, env=env)
        await freed(srv)
    h, d = POLICY["action_horizon"], POLICY["action_dims"]
    assert out["numpy"].startswith("1.")
    assert out["ticks"] == [{"shape": [h, d], "dtype": "float32", "step": i, "stale": False} for i in range(3)]
    assert out["reset"] == 1
