"""The front ends: `streamserve serve` (HTTP + WebSocket on one port) and its wire protocols, in layers whose folders
say which is which:

    service/      the session service: protocol-neutral session operations (service.py), their results (results.py),
                  the registry of resumable sessions, limits, quotas and auth decisions (auth.py), chat, audio and
                  image sessions, the drain's hand-off
    transports/   moving frames and HTTP: the connection transport (transport.py), client addresses and `Expect`
                  (clients.py), shared HTTP errors, the demo's static files
    adapters/     one protocol adapter per wire format over adapter.py: native.py (protocol.py decodes with no I/O and
                  no torch), realtime/, webrtc/, policy/, openai_http/, secrets_route.py
    media/        the media runtime: voice/ (models, Listener, Speaker, STT/TTS scheduling), vision.py, threads.py,
                  loaders.py, media_budget.py

Imports run adapters -> service -> media, and adapters -> transports; tests/test_layout.py checks it. The composition
root stays here: app.py (routes, lifecycle, auth at the upgrade) and drain.py. Imports the engine, never the other way
round."""
