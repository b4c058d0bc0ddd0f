"""The engine: models, sessions on the KV cache, sampling. Imports kernels and sessions, never the server."""

from streamserve.engine.engine import Engine
from streamserve.engine.session import Session
from streamserve.engine.state import SessionStatus

__all__ = ["Engine", "Session", "SessionStatus"]
