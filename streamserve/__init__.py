"""streamserve: a real-time streaming interaction server for large language models.

`from streamserve import Engine` is the Python API (see the README). The engine is imported lazily so
that `streamserve.errors`, `streamserve.kernels` and `streamserve.sessions` stay light to import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamserve.checkout import keep_installed_packages_first
from streamserve.version import __version__

keep_installed_packages_first()  # before anything imports transformers (see streamserve/checkout.py)

__all__ = ["Engine", "Session", "__version__"]

if TYPE_CHECKING:
    from streamserve.engine import Engine, Session


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Session"):
        from streamserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'streamserve' has no attribute {name!r}")
