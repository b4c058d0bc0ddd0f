"""One decoded observation of `/v1/policy`, checked before anything is queued (I/O-free).

openpi's part: a map holding the codec's state key (a float vector [Ds]), optionally its prompt key (a string), and
each of the codec's `image_keys` (a camera image: uint8 [H, W, 3], or JPEG/PNG bytes; checked here, decoded later on
the vision thread); other keys (cameras a policy does not read, anything else) are ignored. The state becomes the
codec's `state_parts` (its bin ids, or for a "projector" policy [<obs>], one embedding [1, hidden], [<act>]).
streamserve's extensions, all optional (openpi's client sends none of them, and then behaves exactly as with
openpi's server):

    reset        true: this observation starts a new episode (a new session; the old one is freed). Alone
                 (no state) it is only acknowledged: the reply is {"reset": true, "episode": n, "server_timing"}
    deadline_ms  the reply is due this many ms after the observation arrives (raised to --min-deadline-ms)
    deadline     the same as an absolute time, Unix seconds (time.time() of a clock synchronised with the server's)
    timestamp    the client's time of the observation, any clock, seconds: echoed, and the episode's step clock
    step         the client's control step of the observation (int >= 0): overrides the step clock
    action_prefix  real-time chunking: the actions [k, D] (0 <= k < H) the robot executes from `step` on while this
                 observation's chunk is computed; they become the chunk's first k rows (appended with the state as
                 forced tokens) and only the other H - k rows are decoded, conditioned on them
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamserve.media.vision import MAX_IMAGE_BYTES, MAX_PIXELS
from streamserve.robot.codec import PolicyCodec, PolicyInputError
from streamserve.robot.projector import StateProjector

MAX_PROMPT_CHARS = 4096  # an instruction longer than this is refused before tokenizing
EXTENSION_KEYS = ("reset", "deadline_ms", "deadline", "timestamp", "step", "action_prefix")


@dataclass
class Observation:
    arrival: float  # time.monotonic() at the frame's arrival
    reset: bool
    parts: list[list[int] | np.ndarray] | None  # codec.state_parts: ids or [1, hidden]; None: a bare reset
    prompt: str
    deadline: float | None  # time.monotonic() the reply is due by; None: no deadline (openpi's blocking RPC)
    timestamp: float | None  # the client's, echoed
    step: int | None  # the client's; else the server's step clock assigns it at arrival (connection.py)
    episode: int = 0  # the connection's episode it belongs to (assigned at arrival)
    answered: bool = False  # its one reply went out (or it was replaced while queued: it gets none)
    timer: asyncio.TimerHandle | None = None  # fires at the deadline: the stale reply
    images: list[tuple[str, np.ndarray | bytes]] = field(default_factory=list)  # (key, image), image_keys' order
    prefix: list[int] = field(default_factory=list)  # action_prefix's k*D ids: the chunk's forced first rows

    @property
    def state_ids(self) -> list[int] | None:
        """The token ids of the state's parts ([<obs>, s_1 .. s_Ds, <act>]; a projected state's markers only)."""
        return None if self.parts is None else [i for p in self.parts if isinstance(p, list) for i in p]


def check_image(key: str, value: Any) -> np.ndarray | bytes:
    """A camera image of the observation, checked before it is queued: uint8 [H, W, 3] of at most MAX_PIXELS, or
    non-empty encoded bytes of at most MAX_IMAGE_BYTES (a damaged file is found when it is decoded)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not 0 < len(value) <= MAX_IMAGE_BYTES:
            raise PolicyInputError(f"the image {key!r} is {len(value)} bytes: send 1 to {MAX_IMAGE_BYTES}")
        return bytes(value)
    if not isinstance(value, np.ndarray):
        raise PolicyInputError(f"the image {key!r} must be a uint8 array [H, W, 3] or JPEG/PNG bytes, got "
                               f"{type(value).__name__}")
    if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3 or 0 in value.shape:
        raise PolicyInputError(f"the image {key!r} must be uint8 [H, W, 3], got {value.dtype} {list(value.shape)}")
    if value.shape[0] * value.shape[1] > MAX_PIXELS:
        raise PolicyInputError(f"the image {key!r} has {value.shape[0] * value.shape[1]} pixels, over the limit of "
                               f"{MAX_PIXELS}")
    return value


def _number(obs: dict[str, Any], key: str) -> float | None:
    v = obs.get(key)
    if isinstance(v, np.generic):  # an openpi __npgeneric__ scalar
        v = v.item()
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise PolicyInputError(f"{key!r} must be a finite number, got {v!r:.40}")
    return float(v)


def parse_observation(obs: Any, codec: PolicyCodec, min_deadline_ms: float, arrival: float | None = None,
                      wall: float | None = None, projector: StateProjector | None = None) -> Observation:
    """A decoded frame -> an Observation; PolicyInputError for anything the codec or the extensions refuse."""
    if not isinstance(obs, dict):
        raise PolicyInputError(f"an observation must be a map, got {type(obs).__name__}")
    arrival = time.monotonic() if arrival is None else arrival
    reset = obs.get("reset", False)
    reset = reset.item() if isinstance(reset, np.generic) else reset
    if not isinstance(reset, bool):
        raise PolicyInputError(f"'reset' must be true or false, got {reset!r:.40}")
    parts, images, prefix = None, [], []
    if not reset or codec.state_key in obs:  # a bare reset carries no state (nor images)
        parts = codec.state_parts(codec.state_of(obs), projector)
        for key in codec.image_keys:
            if key not in obs:
                raise PolicyInputError(f"the observation has no image {key!r} (this policy reads "
                                       f"{list(codec.image_keys)})")
            images.append((key, check_image(key, obs[key])))
        if obs.get("action_prefix") is not None:
            prefix = codec.prefix_ids(obs["action_prefix"])
    prompt = codec.prompt_of(obs)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise PolicyInputError(f"the prompt is {len(prompt)} characters, over the limit of {MAX_PROMPT_CHARS}")
    deadline_ms, absolute = _number(obs, "deadline_ms"), _number(obs, "deadline")
    if deadline_ms is not None and absolute is not None:
        raise PolicyInputError("give one of 'deadline_ms' and 'deadline', not both")
    if absolute is not None:  # Unix seconds -> ms from now
        deadline_ms = (absolute - (time.time() if wall is None else wall)) * 1e3
    deadline = None
    if deadline_ms is not None:
        if deadline_ms > 3.6e6:
            raise PolicyInputError("a deadline more than an hour away is not a control deadline")
        deadline = arrival + max(deadline_ms, min_deadline_ms) / 1e3
    step = obs.get("step")
    step = step.item() if isinstance(step, np.generic) else step
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 53):
        raise PolicyInputError(f"'step' must be an integer >= 0, got {step!r:.40}")
    return Observation(arrival, reset, parts, prompt, deadline, _number(obs, "timestamp"), step, images=images,
                       prefix=prefix)
