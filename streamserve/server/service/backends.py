"""What runs the model behind the session service: the engine in this process (`--backend engine`, the default)
or an SGLang server's streaming sessions (`--backend sglang`: engine/remote/, docs/scale.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streamserve.config import EngineConfig, SchedulerConfig
from streamserve.errors import InvalidInputError
from streamserve.server.media.loaders import engine_loader


def backend_loader(engine: EngineConfig, scheduler: SchedulerConfig | None = None) -> Callable[[], Any]:
    """A loader (run in a worker thread after the port is open) of the engine the config names."""
    if engine.backend == "engine":
        if engine.sglang_url or engine.sglang_launch:
            raise InvalidInputError("--sglang-url and --sglang-launch need --backend sglang")
        return engine_loader(engine, scheduler)

    def load() -> Any:
        from streamserve.engine.remote import SGLangEngine

        return SGLangEngine.start(engine.model, engine.sglang_url, engine.sglang_launch, engine.sglang_python,
                                  scheduler, engine.offline)
    return load
