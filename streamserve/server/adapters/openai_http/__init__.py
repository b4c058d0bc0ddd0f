"""The OpenAI HTTP APIs on the session service (docs/openai.md): a protocol adapter, like server/adapters/native.py and
server/adapters/realtime/, with the server's auth, Origin rules, limits and quotas.

    GET  /v1/models, /v1/models/{model}            what is served (routes.py)
    POST /v1/chat/completions                      stream or not; a request that extends a conversation a resident
                                                   session holds appends only its new messages (chat_completions.py)
    POST /v1/responses; GET, DELETE /v1/responses/{id}; POST /v1/responses/{id}/cancel; GET .../input_items
                                                   previous_response_id continues the session that holds it
                                                   (responses.py)
    /v1/conversations[/{id}[/items[/{item}]]]     a conversation is a session plus its items (conversations.py)
    POST /v1/audio/transcriptions, /v1/audio/speech   the voice models as services (audio.py)

Sessions: turns.py (which session a turn runs on: continue, fork, restore, prefill); stored state: store.py.
"""

from streamserve.server.adapters.openai_http.routes import OpenAIHttp

__all__ = ["OpenAIHttp"]
