"""Fixtures of the policy endpoint's tests: a tiny random Llama checkpoint (transformers) with a policy.json written
for it (the contract of docs/robot.md: markers, state and action bins after the byte tokenizer's ids), and one
server per module serving it on its main port and on a policy port of its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
from helpers import make_checkpoint
from serving import RunningServer

from streamserve.config import ServerConfig
from streamserve.engine import Engine

# ids: 0..256 the byte tokenizer's, 257 <obs>, 258 <act>, 259 <task>, 260..275 state bins, 276..291 action bins (< 300)
POLICY = {"format": 1, "state_key": "observation/state", "state_low": [-1.0, -1.0, -2.0], "state_high": [1.0, 1.0, 2.0],
          "state_bins": 16, "state_token_offset": 260, "action_dims": 2, "action_horizon": 4,
          "action_low": [-1.0, -0.5], "action_high": [1.0, 0.5], "action_bins": 16, "action_token_offset": 276,
          "obs_token": 257, "act_token": 258, "task_token": 259, "prompt_key": "prompt", "default_prompt": "reach",
          "window": 96, "sinks": 4, "control_hz": 50.0}
POLICY_CONFIG = ServerConfig(policy_port=0, messages_per_second=1000.0, max_frame_bytes=1 << 16)


@pytest.fixture(scope="session")
def policy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("policy") / "tiny-policy"
    make_checkpoint(folder, "llama", seed=3)
    (folder / "policy.json").write_text(json.dumps(POLICY))
    return folder


def loader(folder: Path) -> Callable[[], Engine]:
    return lambda: Engine.from_pretrained(folder, device="cpu", kv_memory="64MiB")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def policy_server(policy_checkpoint: Path) -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(POLICY_CONFIG, loader(policy_checkpoint))
    yield srv
    await srv.stop()
