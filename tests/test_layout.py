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
    "streamserve/engine": ("streamserve.server", "streamserve.cli", "streamserve.media"),
    # media: I/O-free building blocks (audio, VAD, speech to text, text to speech) that the server schedules
    "streamserve/media": ("streamserve.engine", "streamserve.server", "streamserve.cli", "streamserve.sessions"),
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


# ---- the server's layers (issue 35): each module's layer is its folder under streamserve/server/ ----
ROOT_MODULES = ("streamserve.server.app", "streamserve.server.drain")  # the composition root: imports every layer
SERVER_LAYERS = {
    # the session service: protocol-neutral session operations, over the engine and the media runtime
    "streamserve/server/service": ("streamserve.server.transports", "streamserve.server.adapters", *ROOT_MODULES),
    # transports move frames and HTTP of any protocol: nothing of the service, the media runtime or the adapters
    "streamserve/server/transports": ("streamserve.server.service", "streamserve.server.media",
                                      "streamserve.server.adapters", *ROOT_MODULES),
    # the media runtime (voice and vision models, their threads and budgets) knows no session, transport or protocol
    "streamserve/server/media": ("streamserve.server.service", "streamserve.server.transports",
                                 "streamserve.server.adapters", *ROOT_MODULES),
    # protocol adapters may import the service, the transports and the media runtime; only app.py wires them up
    "streamserve/server/adapters": ROOT_MODULES,
}


@pytest.mark.parametrize("layer", list(SERVER_LAYERS))
def test_server_layers_import_one_way(layer: str) -> None:
    bad = [(str(p.relative_to(ROOT)), name) for p in (ROOT / layer).rglob("*.py") for name in imports_of(p)
           if any(name == f or name.startswith(f + ".") for f in SERVER_LAYERS[layer])]
    assert not bad, f"imports against the server's layers (streamserve/server/__init__.py): {bad}"


def test_every_server_module_is_in_a_layer() -> None:
    """Only the composition root and the package's __init__ sit at streamserve/server/'s top level."""
    top = {p.name for p in (ROOT / "streamserve/server").glob("*.py")}
    folders = {p.name for p in (ROOT / "streamserve/server").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == {"__init__.py", "app.py", "drain.py"}, f"put these in a layer's folder: {top}"
    assert folders == {Path(layer).name for layer in SERVER_LAYERS}, f"not a layer of the server: {folders}"


def test_kernels_and_sessions_are_installed_inside_streamserve() -> None:
    import streamserve.kernels
    import streamserve.sessions

    assert Path(streamserve.kernels.__file__).parent == ROOT / "kernels"
    assert Path(streamserve.sessions.__file__).parent == ROOT / "sessions"


def test_protocol_module_has_no_io_and_no_torch() -> None:
    names = imports_of(ROOT / "streamserve/server/adapters/protocol.py")
    assert not {n for n in names if n.split(".")[0] in ("torch", "aiohttp", "asyncio", "socket", "websockets")}


def test_no_python_file_is_oversized() -> None:
    big = [str(p.relative_to(ROOT)) for d in ("streamserve", "kernels", "sessions", "clients")
           for p in (ROOT / d).rglob("*.py") if len(p.read_text().splitlines()) > 400]
    assert not big, f"split these files by responsibility: {big}"


# ---- one owner per piece of state (issue 11): no import cycles, no reads of another object's privates ----
PACKAGES = {"streamserve": ROOT / "streamserve", "streamserve.kernels": ROOT / "kernels",
            "streamserve.sessions": ROOT / "sessions"}


def _modules() -> dict[str, Path]:
    """Every module of the installed tree by dotted name (packages by their __init__)."""
    mods: dict[str, Path] = {}
    for pkg, folder in PACKAGES.items():
        for p in folder.rglob("*.py"):
            if pkg == "streamserve" and p.relative_to(folder).parts[0] in ("kernels", "sessions"):
                continue
            parts = list(p.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = p
    return mods


def _edges(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (anywhere in the file: TYPE_CHECKING and function-level imports
    count too). `from pkg import sub` is an edge to the submodule; a parent package's implicit import is not."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    out.add(sub)
                elif base in mods:
                    out.add(base)
    out.discard(name)
    return out


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _edges(m, p, mods) for m, p in mods.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n):], n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles (DESIGN.md §1: imports run one way):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_no_module_reads_another_objects_private_attributes() -> None:
    """`x._name` is only allowed on `self` and `cls` (and a class's own name inside its body is not needed), on
    `super()` (a subclass extending its base's hook, e.g. `nn.Module._apply`), and on `torch.ops.aten` (ATen's
    operators are named so: `_weight_int8pack_mm` is an op, not another object's state)."""
    bad = []
    for d in ("streamserve", "kernels", "sessions", "clients/python"):
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                        and not (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                                 and node.value.func.id == "super")
                        and ast.unparse(node.value) != "torch.ops.aten"):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not bad, "reads of another object's private attributes:\n" + "\n".join(bad)
