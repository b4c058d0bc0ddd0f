"""A simulated planar two-link arm that must bring its hand to a target, its scripted expert, and a closed-loop runner.

NumPy only. The arm has two revolute joints (shoulder at the origin, links `L1`, `L2` metres) driven by
joint-velocity commands at 50 Hz. The shoulder turns freely (its angle is reported wrapped into [-pi, pi)); the
elbow stays between its limits on one side (`Q2_MIN`..`Q2_MAX`), so the inverse kinematics of every target in the
annulus the episodes draw from has one solution and the Jacobian is never singular inside the limits.

Observation (openpi style): {"observation/state": float32 [6] = (q1, q2, target x, target y, target x - hand x,
target y - hand y), "prompt": "reach the target"}. Action chunk: float32 [H, 2] joint velocities (rad/s), one row
per 20 ms tick. An episode succeeds when the hand comes within `TOLERANCE` metres of the target before its time
limit. The expert is damped resolved-rate control: the hand is driven toward the target at a speed proportional
to the distance, through the damped pseudo-inverse of the Jacobian, scaled into the joint-velocity limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

L1, L2 = 0.5, 0.5  # link lengths (m): the hand reaches up to 1 m from the shoulder
DT = 1.0 / 50.0  # control period (s)
QD_MAX = 2.0  # joint-velocity limit (rad/s), both joints
Q2_MIN, Q2_MAX = 0.15, np.pi - 0.15  # elbow limits (rad)
TARGET_R = (0.3, 0.9)  # targets are drawn in this annulus (m), where the elbow's inverse kinematics lies in limits
TOLERANCE = 0.05  # success radius (m)
TIME_LIMIT = 250  # ticks (5 s) to reach a target
STATE_KEY, PROMPT_KEY, PROMPT = "observation/state", "prompt", "reach the target"
# the declared ranges of the state vector's dimensions (the codec's bins cover these; offsets beyond are clipped)
STATE_LOW = (-np.pi, 0.0, -1.0, -1.0, -1.0, -1.0)
STATE_HIGH = (np.pi, np.pi, 1.0, 1.0, 1.0, 1.0)
ACTION_LOW, ACTION_HIGH = (-QD_MAX, -QD_MAX), (QD_MAX, QD_MAX)
EVAL_SEEDS = tuple(range(100_000, 100_050))  # the fixed seeded episodes a policy is scored on (never trained on)

# the expert's gains
GAIN = 5.0  # 1/s: desired hand velocity = GAIN * offset
V_MAX = 1.2  # m/s: cap of the desired hand speed
DAMPING = 0.05  # damped-least-squares lambda (m)

Policy = Callable[[dict[str, Any]], np.ndarray]  # observation -> action chunk [H, 2]


def wrap(angle: float) -> float:
    return float((angle + np.pi) % (2 * np.pi) - np.pi)


def hand(q: np.ndarray) -> np.ndarray:
    """Joint angles [2] -> hand position [2] (m)."""
    return np.array([L1 * np.cos(q[0]) + L2 * np.cos(q[0] + q[1]), L1 * np.sin(q[0]) + L2 * np.sin(q[0] + q[1])])


def jacobian(q: np.ndarray) -> np.ndarray:
    """d hand / d q [2, 2]."""
    s1, c1, s12, c12 = np.sin(q[0]), np.cos(q[0]), np.sin(q[0] + q[1]), np.cos(q[0] + q[1])
    return np.array([[-L1 * s1 - L2 * s12, -L2 * s12], [L1 * c1 + L2 * c12, L2 * c12]])


def step(q: np.ndarray, qd: np.ndarray) -> np.ndarray:
    """One tick: the commanded joint velocities [2], clipped to the limits, integrated for DT; the elbow stops
    at its limits; NaN/inf commands hold still (a robot never executes them)."""
    qd = np.asarray(qd, dtype=np.float64)
    qd = np.where(np.isfinite(qd), np.clip(qd, -QD_MAX, QD_MAX), 0.0)
    nq = q + qd * DT
    return np.array([wrap(nq[0]), float(np.clip(nq[1], Q2_MIN, Q2_MAX))])


def state_vector(q: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The observation's state [6] float32: q1, q2, target x, y, and the offset from the hand to the target."""
    off = target - hand(q)
    return np.array([q[0], q[1], target[0], target[1], off[0], off[1]], dtype=np.float32)


def observation(q: np.ndarray, target: np.ndarray, prompt: str = PROMPT) -> dict[str, Any]:
    return {STATE_KEY: state_vector(q, target), PROMPT_KEY: prompt}


def expert_velocity(q: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Damped resolved-rate control: joint velocities [2] that move the hand toward the target."""
    off = target - hand(q)
    dist = float(np.linalg.norm(off))
    v = off * (GAIN if GAIN * dist <= V_MAX else V_MAX / max(dist, 1e-9))  # desired hand velocity [2]
    j = jacobian(q)
    qd = j.T @ np.linalg.solve(j @ j.T + DAMPING**2 * np.eye(2), v)
    peak = float(np.abs(qd).max())
    return qd * (QD_MAX / peak) if peak > QD_MAX else qd  # scaled as a whole: the hand keeps its direction


def expert_chunk(q: np.ndarray, target: np.ndarray, horizon: int) -> np.ndarray:
    """The expert's next `horizon` commands [H, 2] float32: its control law rolled out on the model of the arm."""
    out = np.empty((horizon, 2), dtype=np.float32)
    for h in range(horizon):
        out[h] = qd = expert_velocity(q, target)
        q = step(q, qd)
    return out


class ExpertPolicy:
    """The scripted expert as a policy: reads only the observation (joint angles and target), like a model does."""

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        s = np.asarray(obs[STATE_KEY], dtype=np.float64)
        return expert_chunk(s[:2], s[2:4], self.horizon)


def random_target(rng: np.random.Generator) -> np.ndarray:
    r, a = rng.uniform(*TARGET_R), rng.uniform(-np.pi, np.pi)
    return np.array([r * np.cos(a), r * np.sin(a)])


def random_start(rng: np.random.Generator, target: np.ndarray) -> np.ndarray:
    """Joint angles at least 4 tolerances away from the target (an episode starting there would be trivial)."""
    while True:
        q = np.array([rng.uniform(-np.pi, np.pi), rng.uniform(Q2_MIN + 0.2, Q2_MAX - 0.2)])
        if np.linalg.norm(hand(q) - target) > 4 * TOLERANCE:
            return q


def episode_start(arm_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeded episode: (start joint angles [2], target [2])."""
    rng = np.random.default_rng(arm_seed)
    target = random_target(rng)
    return random_start(rng, target), target


@dataclass
class EpisodeResult:
    success: bool  # the hand came within TOLERANCE of the target before the time limit
    ticks: int  # control ticks run (the tick of success, or the limit)
    queries: int  # policy calls
    final_distance: float  # hand-to-target distance at the end (m)
    min_distance: float


@dataclass
class LongResult:
    ticks: int
    queries: int
    targets: int  # targets set (the last one may still have been in progress at the end)
    reached: int  # targets reached within their time limit
    missed: int  # targets whose time limit ran out
    reach_ticks: list[int] = field(default_factory=list)  # ticks each reached target took

    @property
    def success_rate(self) -> float:
        done = self.reached + self.missed
        return self.reached / done if done else 0.0


def _chunk(policy: Policy, obs: dict[str, Any]) -> np.ndarray:
    chunk = np.asarray(policy(obs), dtype=np.float64)
    if chunk.ndim != 2 or chunk.shape[1] != 2 or chunk.shape[0] < 1:
        raise ValueError(f"a policy must return an action chunk [H, 2], got shape {list(chunk.shape)}")
    return chunk


def run_episode(arm_seed: int, policy: Policy, replan_every: int, time_limit: int = TIME_LIMIT,
                prompt: str = PROMPT) -> EpisodeResult:
    """One seeded episode in closed loop: every `replan_every` ticks the policy gets the observation and its chunk's
    first rows are executed (all of them when the chunk is shorter). Ends at success or after `time_limit` ticks."""
    if replan_every < 1:
        raise ValueError("replan_every must be >= 1")
    q, target = episode_start(arm_seed)
    dist = best = float(np.linalg.norm(hand(q) - target))
    queries = tick = 0
    while tick < time_limit:
        chunk = _chunk(policy, observation(q, target, prompt))
        queries += 1
        for qd in chunk[:replan_every]:
            q = step(q, qd)
            tick += 1
            dist = float(np.linalg.norm(hand(q) - target))
            best = min(best, dist)
            if dist <= TOLERANCE:
                return EpisodeResult(True, tick, queries, dist, best)
            if tick >= time_limit:
                break
    return EpisodeResult(False, tick, queries, dist, best)


def run_long(arm_seed: int, policy: Policy, replan_every: int, ticks: int, time_limit: int = TIME_LIMIT,
             hold: int = 10, prompt: str = PROMPT) -> LongResult:
    """One endless-style episode of `ticks` ticks with changing targets: a target is replaced `hold` ticks after
    the hand reached it, or when its time limit ran out; the arm carries on from wherever it is."""
    rng = np.random.default_rng(arm_seed)
    target = random_target(rng)
    q = random_start(rng, target)
    res = LongResult(0, 0, 1, 0, 0)
    since, reached_at = 0, None  # ticks on the current target; tick it was reached
    while res.ticks < ticks:
        chunk = _chunk(policy, observation(q, target, prompt))
        res.queries += 1
        for qd in chunk[:replan_every]:
            q = step(q, qd)
            res.ticks += 1
            since += 1
            if reached_at is None and np.linalg.norm(hand(q) - target) <= TOLERANCE:
                reached_at = since
                res.reached += 1
                res.reach_ticks.append(since)
            if (reached_at is not None and since >= reached_at + hold) or (reached_at is None and since >= time_limit):
                res.missed += reached_at is None
                target, since, reached_at = random_target(rng), 0, None
                res.targets += 1
            if res.ticks >= ticks:
                break
    return res


def success_rate(seeds: list[int], policy_for: Callable[[], Policy], replan_every: int,
                 on_episode: Callable[[int, EpisodeResult], None] | None = None) -> float:
    """The fraction of the seeded episodes a policy succeeds in; `policy_for()` gives a fresh policy (a new
    episode: a new session) for each."""
    wins = 0
    for s in seeds:
        r = run_episode(s, policy_for(), replan_every)
        wins += r.success
        if on_episode is not None:
            on_episode(s, r)
    return wins / len(seeds) if seeds else 0.0


def describe(obs: Mapping[str, Any]) -> str:
    s = np.asarray(obs[STATE_KEY])
    return f"q=({s[0]:+.2f},{s[1]:+.2f}) target=({s[2]:+.2f},{s[3]:+.2f}) offset=({s[4]:+.3f},{s[5]:+.3f})"
