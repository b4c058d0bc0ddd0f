"""Fixtures of the engine tests: the default model in a small pool, and `engine`, each embedding test run on the
default model and on a tiny random Qwen3 (tests/conftest.py's `engines`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamserve import Engine


@pytest.fixture(scope="module")
def default_engine() -> Iterator[Engine]:
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="64MiB")
    yield engine
    engine.shutdown()


@pytest.fixture(params=["default", "qwen3"])
def engine(request: pytest.FixtureRequest, engines: dict[str, Engine], default_engine: Engine) -> Engine:
    return default_engine if request.param == "default" else engines["qwen3"]
