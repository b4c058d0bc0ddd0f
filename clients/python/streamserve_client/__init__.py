"""Python client of streamserve's native streaming protocol (msgpack over WebSocket; no torch).

    async with streamserve_client.connect("ws://127.0.0.1:8000", api_key=None) as client:
        session = await client.open_session(window=None, sinks=4)
        ack = await session.append(text="...")
        async for delta in session.respond(max_tokens=32, temperature=0.0):
            print(delta.text, end="")
"""

from streamserve_client.actions import ActionQueue
from streamserve_client.channel import Channel
from streamserve_client.client import Client, connect
from streamserve_client.errors import (
    CallTimeoutError,
    CapacityError,
    ConnectionLostError,
    EngineFailedError,
    InvalidInputError,
    NotSupportedError,
    ProtocolViolationError,
    ServerBusyError,
    StepFailedError,
    StreamserveClientError,
    UnauthorizedError,
    UnknownSessionError,
    UnsupportedModalityError,
)
from streamserve_client.events import (
    Event,
    ReplyAudio,
    ReplyAudioDone,
    ReplyDone,
    ReplyText,
    SpeechStarted,
    SpeechStopped,
    TranscriptDelta,
    TranscriptFinal,
    TranscriptPartial,
)
from streamserve_client.policy import PolicyClient, SyncPolicyClient
from streamserve_client.protocol import Ack, Delta
from streamserve_client.session import Response, Session
from streamserve_client.sync import SyncClient, SyncSession

__version__ = "0.1.0"

__all__ = ["Ack", "CallTimeoutError", "CapacityError", "Channel", "Client", "ConnectionLostError", "Delta",
           "EngineFailedError", "Event", "InvalidInputError", "NotSupportedError", "ProtocolViolationError",
           "ReplyAudio", "ReplyAudioDone", "ReplyDone", "ReplyText", "Response", "ServerBusyError", "Session",
           "SpeechStarted", "SpeechStopped", "StepFailedError", "StreamserveClientError", "SyncClient", "SyncSession",
           "TranscriptDelta", "TranscriptFinal", "TranscriptPartial", "UnauthorizedError", "UnknownSessionError",
           "UnsupportedModalityError", "connect"]
__all__ += ["ActionQueue", "PolicyClient", "SyncPolicyClient"]  # the robot policy endpoint (policy.py, actions.py)
