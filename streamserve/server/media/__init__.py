"""The media runtime: the server's voice and vision models loaded once and the threads they run on, off the event
loop and the engine thread. voice/ (VoiceRuntime, the Listener and Speaker of each stream, speech-to-text and
text-to-speech scheduling, speculated replies' gate), vision.py (VisionRuntime), threads.py (one thread budget over
the cores), loaders.py (the engine, voice and vision loaders) and media_budget.py (the byte budgets of media held).
Over streamserve.media (I/O-free) and the engine; it never imports the session service (server/service/), a
transport (server/transports/), a protocol adapter (server/adapters/) or the composition root (app.py, drain.py)."""
