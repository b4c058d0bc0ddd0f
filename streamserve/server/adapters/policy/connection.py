"""`WS /v1/policy` (and `/` on --policy-port): openpi's policy protocol over the session service.

openpi's protocol, which its unchanged `WebsocketClientPolicy` speaks: the server sends the policy's metadata first
(one msgpack map), then answers every observation (a msgpack map with NumPy arrays) with one map holding `actions`
(float32 [H, D]), `server_timing` (`infer_ms`, and `prev_total_ms` from the second reply on) and `policy_timing`
(`infer_ms`: the policy's own time, from the tick's first chunk to its last action token; 0 in a stale reply, which
ran nothing; beyond openpi: `forwards`, the model forwards that made the chunk, and with a draft `draft_tokens` and
`accepted_tokens`); an error is one
text frame saying what went wrong, then close 1011 (a client's mistake included: that is openpi's convention).

Beyond openpi (observation.py; `metadata["streamserve"]` describes them; openpi's client ignores all of it):
- Latest observation wins: the read loop never waits for the model. One observation is in flight and at most ONE
  waits; an observation that arrives while one waits replaces it, and the replaced one gets no reply (openpi's
  blocking client never sends a second before its reply, so it never sees this).
- Deadlines: a reply that would be late is sent at the deadline with `stale: true` and the last chunk's remaining
  actions (shifted by the steps since that chunk was valid from; [0, D] when none remain or none exists yet). The
  late observation's chunk is still decoded (abandoned, not cancelled): it becomes the last chunk, which the next
  stale replies draw from. Cancelling it instead starves an overloaded server: measured with 8 arms on the default
  policy and an 80 ms deadline on this 2-core CPU, cancelling left almost every reply stale and empty (8 of 24
  episodes reached their target); finishing late chunks kept stale replies useful (24 of 24).
- Every reply says `valid_from_step` (the control step its first action is for), the `episode`, and echoes the
  observation's `timestamp`. Steps: the client's `step` if given; else round((t - t0) * control_hz) with t the
  observation's `timestamp` (or arrival time when it has none) and t0 its episode's first observation's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import Counter

from streamserve.errors import SessionClosedError
from streamserve.robot.codec import PolicyCodec
from streamserve.robot.projector import StateProjector
from streamserve.server.adapters import protocol as P
from streamserve.server.adapters.adapter import ProtocolAdapter
from streamserve.server.adapters.policy import wire
from streamserve.server.adapters.policy.episode import Episode, ServiceFailure
from streamserve.server.adapters.policy.observation import EXTENSION_KEYS, Observation, parse_observation
from streamserve.server.service.auth import Grant
from streamserve.server.service.results import Pushed, service_error
from streamserve.server.service.service import SessionService
from streamserve.server.transports.transport import Frame, Transport

log = logging.getLogger("streamserve.server")
POLICY_TIMING_KEYS = ("forwards", "draft_tokens", "accepted_tokens")  # of the reply's usage, in policy_timing

PROTOCOL = 1  # metadata["streamserve"]["protocol"]: bumped when an extension changes incompatibly
CLOSE_REASON = "error: see the previous (text) frame"


@dataclass(frozen=True)
class Chunk:
    episode: int
    step: int  # valid_from_step: the control step of actions[0]
    actions: np.ndarray  # [H, D] float32


class PolicyConnection(ProtocolAdapter):
    def __init__(self, service: SessionService, transport: Transport, grant: Grant, messages: Counter,
                 codec: PolicyCodec | None, refusal: str, projector: StateProjector | None = None) -> None:
        super().__init__(service, transport, grant)
        self.messages, self.codec, self.refusal = messages, codec, refusal  # refusal: why no codec, for the client
        self.projector = projector  # a "projector" policy's state map (robot/codec.py)
        self.max_bytes = service.config.max_frame_bytes
        self.queued: Observation | None = None  # the one waiting observation (latest wins)
        self.current: Observation | None = None  # the one in flight
        self.wake = asyncio.Event()  # an observation was queued
        self.arrived_episode = 0  # episode numbers and step clocks follow arrival order
        self.clock: tuple[float, float | None] = (0.0, None)  # (arrival, timestamp) of the episode's first obs
        self.clock_set = False
        self.episode: Episode | None = None
        self.last: Chunk | None = None
        self.prev_total_ms: float | None = None
        self.worker: asyncio.Task | None = None
        self.failed = False

    # ---- what the adapter must say ----------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        assert self.codec is not None
        c, cfg = self.codec, self.service.config
        return {**c.metadata(), "streamserve": {
            "protocol": PROTOCOL, "model": self.service.engine.name, "action_shape": [c.action_horizon, c.action_dims],
            "observation_keys": list(EXTENSION_KEYS), "reply_keys": ["stale", "valid_from_step", "episode",
                                                                    "timestamp", "reset", "policy_timing"],
            "latest_observation_wins": True, "max_queued_observations": 1, "min_deadline_ms": cfg.min_deadline_ms,
            "deadline_clock": "unix", "max_frame_bytes": self.max_bytes, "errors": "text frame, then close 1011",
            "images": self.images_info()}}

    def images_info(self) -> dict[str, Any] | None:
        """What the policy's camera images become: "labels" (a text note of their ImageNet labels, appended when
        they change) or "encoder" (the model's image embeddings); None for a policy that reads no images."""
        info = self.service.images.info()
        if self.codec is None or not self.codec.image_keys or info is None:
            return None
        return {"input": info.input, "model": info.model, "max_pixels": info.max_pixels}

    async def greet(self) -> None:
        if self.codec is None:
            await self.fail_with(self.refusal)
            return
        await self.transport.send(wire.packb(self.metadata()))

    def render_pushed(self, result: Pushed) -> list[Frame]:
        return []  # results go to the episode (push), never straight to the client

    async def push(self, result: Pushed) -> None:
        if self.episode is not None:
            self.episode.on_result(result)

    def push_nowait(self, result: Pushed) -> bool:
        if self.episode is not None:
            self.episode.on_result(result)
        return True

    # ---- the read loop: decode, check, queue (never waits for the model) -------------------------------------
    async def run(self) -> None:
        self.transport.start()
        try:
            await self.greet()
            if not self.failed:
                self.worker = asyncio.create_task(self.work())
            async for frame in self.transport.frames():
                await self.handle(frame)
        finally:
            await self.teardown()
            await self.transport.finish()

    async def handle(self, frame: Frame) -> None:
        if self.failed or self.codec is None:
            return
        try:
            raw = wire.unpackb(frame, self.max_bytes)
            obs = parse_observation(raw, self.codec, self.service.config.min_deadline_ms, projector=self.projector)
        except Exception as e:  # openpi's convention: the error as text, then 1011
            await self.fail(e)
            return
        self.messages.labels("policy_observation").inc()
        if obs.reset or not self.clock_set:
            self.arrived_episode += obs.reset
            self.clock, self.clock_set = (obs.arrival, obs.timestamp), True
        obs.episode = self.arrived_episode
        if obs.step is None:
            obs.step = self.step_of(obs)
        old = self.queued
        if old is not None:  # latest observation wins: the waiting one is dropped, unanswered
            self.disarm(old)
            old.answered = True
            obs.reset = obs.reset or old.reset  # an episode boundary is never lost with it
        self.queued = obs
        if obs.deadline is not None and obs.parts is not None:
            obs.timer = asyncio.get_running_loop().call_later(max(0.0, obs.deadline - time.monotonic()),
                                                              self.expire, obs)
        self.wake.set()

    def step_of(self, obs: Observation) -> int:
        arrival0, ts0 = self.clock
        dt = obs.timestamp - ts0 if obs.timestamp is not None and ts0 is not None else obs.arrival - arrival0
        assert self.codec is not None
        return max(0, round(dt * self.codec.control_hz))

    # ---- the worker: one observation at a time on the episode's session -----------------------------------
    async def work(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                obs, self.queued = self.queued, None
                if obs is None or (obs.answered and not obs.reset):
                    continue
                self.current = obs
                try:
                    await self.serve(obs)
                finally:
                    self.current = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await self.fail(e)

    async def serve(self, obs: Observation) -> None:
        assert self.codec is not None
        started = time.monotonic()
        if obs.reset or self.episode is None:
            if self.episode is not None:
                await self.episode.close()
            self.episode = Episode(self.service, self.ctx, self.codec, obs.episode,
                                   draft=not self.service.config.no_policy_draft)
        if obs.parts is None:  # a bare reset: acknowledged
            await self.answer(obs, {"reset": True, "episode": obs.episode}, started)
            return
        if obs.answered:  # expired while waiting: its stale reply went out, nothing to compute
            return
        ep = self.episode
        left = None if obs.deadline is None else max(0.0, (obs.deadline - time.monotonic()) * 1e3)
        began = time.monotonic()
        tick = await ep.start(obs.parts, obs.prompt, left, obs.images, obs.step, obs.prefix)
        whole = await ep.settle(tick)  # past the deadline too: the stale reply went out, the chunk is still kept
        ep.tick = None
        policy_timing = {"infer_ms": round((time.monotonic() - began) * 1e3, 3),
                         **{k: v for k, v in tick.usage.items() if k in POLICY_TIMING_KEYS}}
        if obs.prefix:
            policy_timing["prefix_tokens"] = len(obs.prefix)
        if not whole:
            raise SessionClosedError(f"the policy's reply ended after {len(tick.tokens)} of "
                                     f"{self.codec.n_action_tokens} action tokens (its session was closed)")
        assert obs.step is not None
        self.last = Chunk(obs.episode, obs.step, self.codec.actions(tick.tokens))
        if not obs.answered:
            await self.answer(obs, {"actions": self.last.actions, "stale": False, "policy_timing": policy_timing},
                              started)

    # ---- replies ------------------------------------------------------------------------------------------
    def reply(self, obs: Observation, body: dict[str, Any], started: float) -> bytes:
        now = time.monotonic()
        timing = {"infer_ms": round((now - started) * 1e3, 3)}
        if self.prev_total_ms is not None:
            timing["prev_total_ms"] = self.prev_total_ms
        self.prev_total_ms = round((now - obs.arrival) * 1e3, 3)
        out = {**body, "server_timing": timing, "episode": obs.episode}
        if "actions" in body:
            out["valid_from_step"] = obs.step
        if obs.timestamp is not None:
            out["timestamp"] = obs.timestamp
        return wire.packb(out)

    async def answer(self, obs: Observation, body: dict[str, Any], started: float) -> None:
        if obs.answered or self.failed:
            return
        obs.answered = True
        self.disarm(obs)
        await self.transport.send(self.reply(obs, body, started))

    def expire(self, obs: Observation) -> None:
        """The deadline passed with no reply: answer now from the last chunk (its own chunk, if it is in flight, is
        still decoded and becomes the last chunk)."""
        if obs.answered or self.failed:  # nothing follows an error frame
            return
        obs.answered, obs.timer = True, None
        if self.queued is obs:
            self.queued = None
        assert self.codec is not None and obs.step is not None
        last, d = self.last, self.codec.action_dims
        rows = np.zeros((0, d), np.float32)
        if last is not None and last.episode == obs.episode:
            rows = last.actions[min(max(0, obs.step - last.step), len(last.actions)):]
        self.transport.send_nowait(self.reply(obs, {"actions": rows, "stale": True, "policy_timing": {"infer_ms": 0.0}},
                                              obs.arrival))

    def disarm(self, obs: Observation) -> None:
        if obs.timer is not None:
            obs.timer.cancel()
            obs.timer = None

    # ---- errors and the end ----------------------------------------------------------------------------------
    async def fail(self, e: BaseException) -> None:
        err = e.error if isinstance(e, ServiceFailure) else service_error(e)
        await self.fail_with(f"{err.code}: {err.message}")

    async def fail_with(self, text: str) -> None:
        """openpi's error convention: one text frame, then close 1011. Once."""
        if self.failed:
            return
        self.failed = True
        await self.transport.send(text)
        with contextlib.suppress(Exception):
            await self.transport.close(P.CLOSE_INTERNAL, CLOSE_REASON)

    async def teardown(self) -> None:
        """Whatever ended the connection: no timer fires, the worker stops, the episode's session is freed now."""
        for obs in (self.queued, self.current):
            if obs is not None:
                self.disarm(obs)
        if self.worker is not None and self.worker is not asyncio.current_task():
            self.worker.cancel()
            await asyncio.wait({self.worker})
        if self.episode is not None:
            await self.episode.close()
