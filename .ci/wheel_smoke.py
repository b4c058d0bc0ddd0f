"""What a user gets from the built wheels, run by `make wheel-check` from a fresh virtual environment
that holds only those wheels and their dependencies, outside the repository, with `python -I` (so no
source tree can be imported by accident).

    python -I wheel_smoke.py server   # the streamserve wheel: every module imports, one greedy generation
    python -I wheel_smoke.py client   # the streamserve-client wheel: imports without torch
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import sysconfig
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()


def installed(module: object) -> Path:
    path = Path(str(getattr(module, "__file__", ""))).resolve()
    assert path.is_relative_to(SITE), f"{module} comes from {path}, not from the installed wheel in {SITE}"
    return path


def import_every_module(package: object, prefix: str) -> int:
    """Import every module the wheel holds; a missing project module fails, a missing optional third-party
    package (an extra that is not installed) does not."""
    count = 0
    for info in pkgutil.walk_packages(package.__path__, prefix):  # type: ignore[attr-defined]
        if info.name.endswith(".__main__"):
            continue  # `python -m` entry points run on import
        try:
            installed(importlib.import_module(info.name))
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] == "streamserve":
                raise
            print(f"  {info.name}: needs {e.name} (an optional extra)")
        count += 1
    return count


def check_server() -> None:
    import streamserve
    from streamserve import Engine

    installed(streamserve)
    n = import_every_module(streamserve, "streamserve.")
    with Engine.from_pretrained("default", device="cpu", kv_memory="64MiB") as engine:
        replies = []
        for _ in range(2):
            with engine.open_session() as s:
                s.append(text="In the beginning")
                replies.append(s.generate(max_tokens=8, temperature=0.0))
        assert len(replies[0]) == 8 and replies[0] == replies[1], replies
        text = engine.tokenizer.decode(replies[0])
    print(f"streamserve wheel: {n} modules import; greedy generation from the packaged default model: {text!r}")


def check_client() -> None:
    import streamserve_client

    installed(streamserve_client)
    n = import_every_module(streamserve_client, "streamserve_client.")
    heavy = sorted(m for m in ("torch", "streamserve") if m in sys.modules)
    assert not heavy, f"the client imported {heavy}"
    print(f"streamserve-client wheel: {n} modules import, without torch")


if __name__ == "__main__":
    {"server": check_server, "client": check_client}[sys.argv[1]]()
