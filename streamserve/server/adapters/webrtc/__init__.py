"""WebRTC calls (`POST /v1/realtime/calls`, docs/webrtc.md): the OpenAI Realtime protocol on the data channel
`oai-events`, the person's audio on a microphone track, the reply on an audio track, camera frames sampled into the
session. One implementation with /v1/realtime (server/realtime/), another transport: aiortc.

    routes.py   the HTTP endpoints (SDP checks, auth, limits) and the server's live calls
    call.py     one call: the peer, its lifecycle, the Realtime connection's media hook
    channel.py  the data channel as a transport Channel
    tracks.py   the reply track (paced 20 ms frames) and the microphone drain
    video.py    the camera sampler (vision labels -> notes)
"""
