"""The protocol adapters: one per wire format, each rendering the session service's neutral results in its own
shape. The native protocol (native.py over adapter.py's ProtocolAdapter, with protocol.py decoding frames: no I/O, no
torch), the OpenAI Realtime API (realtime/; over WebRTC: webrtc/), openpi's robot policy (policy/), OpenAI's HTTP APIs
(openai_http/) and minting client secrets (secrets_route.py). Adapters may import the session service
(server/service/), the transports (server/transports/) and the media runtime (server/media/), never the composition
root (app.py, drain.py); a new protocol is a new adapter here, never a copy of another."""
