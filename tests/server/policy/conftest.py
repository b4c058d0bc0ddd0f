"""Fixtures of the policy endpoint's tests: a tiny random Llama checkpoint (transformers) with a policy.json written
for it (the contract of docs/robot.md: markers, state and action bins after the byte tokenizer's ids), and one
server per module serving it on its main port and on a policy port of its own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from helpers import make_checkpoint
from policy_fixture import POLICY, POLICY_CONFIG, loader
from serving import RunningServer


@pytest.fixture(scope="session")
def policy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("policy") / "tiny-policy"
    make_checkpoint(folder, "llama", seed=3)
    (folder / "policy.json").write_text(json.dumps(POLICY))
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def policy_server(policy_checkpoint: Path) -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(POLICY_CONFIG, loader(policy_checkpoint))
    yield srv
    await srv.stop()
