"""The import direction of DESIGN.md §1: kernels <- sessions <- engine/models <- server; never back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package folder -> the streamserve modules it must never import
FORBIDDEN = {
    "kernels": ("streamserve.sessions", "streamserve.engine", "streamserve.models", "streamserve.server",
                "streamserve.cli"),
    "sessions": ("streamserve.engine", "streamserve.models", "streamserve.server", "streamserve.cli"),
    "streamserve/models": ("streamserve.engine", "streamserve.server", "streamserve.cli"),
    "streamserve/engine": ("streamserve.server", "streamserve.cli"),
    "streamserve/server": ("streamserve.cli",),
    # clients speak the wire protocol only: no engine, no torch
    "clients/python": ("streamserve.", "torch"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", list(FORBIDDEN))
def test_imports_run_one_way(folder: str) -> None:
    bad = [(str(p.relative_to(ROOT)), name) for p in (ROOT / folder).rglob("*.py")
           for name in imports_of(p) if name.startswith(FORBIDDEN[folder]) or (name in ("streamserve", "torch")
           and folder == "clients/python")]
    assert not bad, f"imports against the direction of DESIGN.md §1: {bad}"


def test_kernels_and_sessions_are_installed_inside_streamserve() -> None:
    import streamserve.kernels
    import streamserve.sessions

    assert Path(streamserve.kernels.__file__).parent == ROOT / "kernels"
    assert Path(streamserve.sessions.__file__).parent == ROOT / "sessions"


def test_protocol_module_has_no_io_and_no_torch() -> None:
    names = imports_of(ROOT / "streamserve/server/protocol.py")
    assert not {n for n in names if n.split(".")[0] in ("torch", "aiohttp", "asyncio", "socket", "websockets")}


def test_no_python_file_is_oversized() -> None:
    big = [str(p.relative_to(ROOT)) for d in ("streamserve", "kernels", "sessions", "clients")
           for p in (ROOT / d).rglob("*.py") if len(p.read_text().splitlines()) > 400]
    assert not big, f"split these files by responsibility: {big}"
