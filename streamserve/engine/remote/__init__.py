"""The SGLang backend (`--backend sglang`): sessions whose KV cache lives in an SGLang server's streaming sessions,
behind the same session service as the engine backend. See docs/scale.md."""

from streamserve.engine.remote.engine import SGLangEngine
from streamserve.engine.remote.http import BackendRequestError, BackendUnavailableError
from streamserve.engine.remote.session import RemoteSession

__all__ = ["BackendRequestError", "BackendUnavailableError", "RemoteSession", "SGLangEngine"]
