"""The session service: every session operation a front end offers (open, resume, append, respond, cancel, rewind,
configure, close, stats), protocol-neutral. Its inputs are plain dataclasses and its answers neutral results
(results.py); it owns the registry of resumable sessions (registry.py), each connection's standing (context.py),
limits, quotas and auth decisions (auth.py), chat, audio and image sessions, and the drain's hand-off (lifecycle.py,
handoff.py). It may import the engine, streamserve.media and the server's media runtime (server/media/), never a
transport (server/transports/), a protocol adapter (server/adapters/) or the composition root (app.py, drain.py)."""
