"""A policy checkpoint driven in-process through the real engine: one persistent session per episode.

`EnginePolicy` is what the server's policy endpoint does per tick, without the network: the episode's session is
opened with the codec's rolling window, the instruction is appended on the first tick (and when it changes), each
tick appends the state's ids and decodes exactly H*D tokens constrained to the action vocabulary (greedy, no stop
ids), and the ids are de-binned into the chunk [H, D]. Tests, the training script's evaluation and benchmarks use it.
A "projector" policy's state goes in as `[<obs>]`, one embedding vector, `[<act>]` (codec.state_parts), exactly as
the endpoint appends it. Camera images need the server's vision path: a policy with image keys is refused here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from streamserve.errors import ModelLoadError
from streamserve.robot.codec import PolicyCodec, PolicyConfigError
from streamserve.robot.projector import StateProjector

if TYPE_CHECKING:
    from streamserve.engine import Engine, Session


def engine_codec(engine: Engine) -> PolicyCodec:
    """The codec of the engine's checkpoint (ModelLoadError when it is not a policy)."""
    codec = PolicyCodec.load(engine.path)
    if codec is None:
        raise ModelLoadError(f"{engine.path} has no policy.json: it is not a robot policy checkpoint")
    return codec


class EnginePolicy:
    """observation dict -> action chunk [H, D] float32, on one session per episode (`reset` starts the next)."""

    def __init__(self, engine: Engine, codec: PolicyCodec | None = None) -> None:
        self.engine = engine
        self.codec = codec if codec is not None else engine_codec(engine)
        if self.codec.image_keys:
            raise PolicyConfigError(f"this policy reads camera images {list(self.codec.image_keys)}: serve it "
                                    "(`streamserve serve`, /v1/policy) so that they go through the vision path")
        self.projector = None  # the checkpoint's, for a "projector" policy
        if self.codec.state_encoding == "projector":
            self.projector = StateProjector.load(engine.path, self.codec, engine.config.hidden_size)
        self.session: Session | None = None
        self.prompt: str | None = None  # the instruction last appended to the session
        self.growth: list[int] = []  # per tick: tokens the session grew by (state + reply; the prompt not counted)
        self.replies: list[list[int]] = []  # per tick: the reply's token ids (kept only when `record` is set)
        self.record = False
        self.ticks = 0

    def _open(self) -> Session:
        if self.session is None:
            self.session = self.engine.open_session(window=self.codec.window, sinks=self.codec.sinks)
            self.prompt = None
        return self.session

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        c = self.codec
        parts = c.state_parts(c.state_of(obs), self.projector)  # bad observations raise here, before any change
        prompt = c.prompt_of(obs)
        s = self._open()
        if prompt != self.prompt:
            s.append(token_ids=c.prompt_ids(self.engine.tokenizer.encode(prompt, add_special_tokens=False)))
            self.prompt = prompt
        before = len(s)
        for part in parts:  # token ids, or a projected state [1, hidden]
            if isinstance(part, list):
                s.append(token_ids=part, kind="state")
            else:
                import torch

                s.append(embeds=torch.from_numpy(part), kind="state")
        reply = s.stream(max_tokens=c.n_action_tokens, temperature=0.0, stop_token_ids=(),
                         allowed_token_ids=c.action_ids)
        reason = reply.wait()
        ids = reply.token_ids
        if reason != "length" or len(ids) != c.n_action_tokens:
            raise RuntimeError(f"the policy reply ended with {reason!r} after {len(ids)} of {c.n_action_tokens} "
                               "tokens")
        self.growth.append(len(s) - before)
        if self.record:
            self.replies.append(list(ids))
        self.ticks += 1
        return c.actions(ids)

    def reset(self) -> None:
        """End the episode: its session is closed (its KV pages go back to the pool)."""
        if self.session is not None:
            self.session.close()
        self.session, self.prompt = None, None

    close = reset

    def __enter__(self) -> EnginePolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()


def engine_success_rate(engine: Engine, seeds: list[int], replan_every: int | None = None,
                        on_episode: Any = None) -> float:
    """Closed-loop success of the engine's policy on seeded arm episodes (a fresh session per episode).
    replan_every: ticks between queries (default: the whole chunk H runs before the next query)."""
    from streamserve.robot import arm

    codec = engine_codec(engine)
    every = replan_every or codec.action_horizon
    wins = 0
    for seed in seeds:
        with EnginePolicy(engine, codec) as policy:
            r = arm.run_episode(seed, policy, every)
        wins += r.success
        if on_episode is not None:
            on_episode(seed, r)
    return wins / len(seeds) if seeds else 0.0
