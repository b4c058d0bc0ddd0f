"""Run from a source checkout, keep installed packages ahead of the checkout's own top-level folders.

`python -m …`, `python -c …` and `python -m pytest` put the current directory first on `sys.path`. In the
repository root that makes `kernels/` (installed as `streamserve.kernels`, DESIGN.md §1) importable as a top-level
`kernels`, which shadows Hugging Face's `kernels` package that transformers imports: every transformers model load
then fails ("cannot import name 'CUDAProperties' from 'kernels'"). Python 3.10 has no `-P` to stop it, so the
checkout's root is moved behind every other entry instead. An installed wheel has no `kernels/` beside its package
folder, so this touches nothing there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root when run from a checkout


def is_checkout(root: Path = CHECKOUT) -> bool:
    """Whether `root` is this repository's root: `kernels/` and `sessions/` packages and a pyproject.toml beside the
    `streamserve/` package (site-packages may hold a `kernels` package, but never a pyproject.toml)."""
    return all((root / name).is_file() for name in ("kernels/__init__.py", "sessions/__init__.py", "pyproject.toml"))


def keep_installed_packages_first(path: list[str] | None = None, root: Path = CHECKOUT) -> bool:
    """Move every entry of `path` (default `sys.path`) that names the checkout root ('' counts as the current
    directory) to its end, in place; True when one was moved. A module already imported from the root stays."""
    path = sys.path if path is None else path
    if not is_checkout(root):
        return False
    moved = [entry for entry in path if Path(os.path.abspath(entry or os.curdir)).resolve() == root]
    for entry in moved:
        path.remove(entry)
    path.extend(moved)
    return bool(moved)
