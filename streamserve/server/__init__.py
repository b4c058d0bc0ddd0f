"""The front ends: `streamserve serve` (HTTP + WebSocket on one port) and its wire protocols, in three layers:
the session service (service.py, protocol-neutral results in results.py), the connection transport
(transport.py) and one adapter per wire protocol (native.py, over adapter.py; protocol.py decodes with no
I/O and no torch). app.py keeps routes, lifecycle and auth (auth.py). Imports the engine, never the other
way round."""
