"""The voice path of the server, protocol-neutral (the native adapter and /v1/realtime both use it):

    runtime.py   VoiceRuntime: the voice models loaded once per server, and the media executor they run on
    listen.py    Listener: input audio -> turn events (server VAD) and transcript text, one per audio stream
    speak.py     Speaker: a reply's streamed text -> audio, sentence by sentence, one per reply

The models and their streaming wrappers are in streamserve.media (I/O-free); this package schedules them off the
event loop and off the engine thread.
"""
