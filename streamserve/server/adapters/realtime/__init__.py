"""`WS /v1/realtime`: the OpenAI Realtime API (GA event set) over the session service (docs/realtime.md).

    events.py        I/O-free: client events parsed and checked, server events rendered (every one with an event_id)
    settings.py      the Realtime session's configuration: session.update checked, the session object rendered
    conversation.py  the conversation's items and their mapping onto ONE persistent chat session
    response.py      one response: the reply's text (and the Speaker's audio) as the response.* event sequence
    listening.py     input audio: the input audio buffer over the Listener (VAD, streaming transcription)
    connection.py    RealtimeConnection, the protocol adapter: frames in, service calls, events out
"""
