"""Behaviour-cloning data for the arm: token streams of expert episodes, cropped the way a rolling session sees them.

NumPy only. A stream is what one episode's session would hold: `[<task>, prompt..]` then per query
`[<obs>, s_1..s_6, <act>]` + the expert's chunk as action ids. The states come from rollouts where the executed
commands are the expert's plus noise (DART-style), so the data covers the states a slightly wrong policy drifts
into, while the labels stay the clean expert chunk. Long streams change targets, so the crops also hold what the
server sees late in an endless episode.

A crop ending at stream length L is exactly what the engine attends to when it produces the token at L - 1 on a
session with `[sinks | window]` rolling positions: the first `sinks` tokens, then the last tokens from
max(sinks, L - window) on, at consecutive positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from streamserve.robot import arm
from streamserve.robot.codec import PolicyCodec

PROMPTS = ("reach the target", "reach the target", "reach the target", "move the hand to the target",
           "touch the target", "go to the goal", "reach for the point")  # mostly the default instruction


@dataclass
class Stream:
    ids: np.ndarray  # [N] int64 token ids of the whole episode
    query: np.ndarray  # [N] int64: index of the <obs> token of the query each token belongs to (-1: prompt)
    is_action: np.ndarray  # [N] bool: the token is an action id (a training target)
    replan: int = 1  # control steps executed between two queries


def expert_stream(rng: np.random.Generator, codec: PolicyCodec, tokenize: Callable[[str], list[int]],
                  queries: int) -> Stream:
    """One episode of `queries` policy calls with noisy execution and changing targets."""
    H = codec.action_horizon
    replan = int(rng.integers(1, H + 1)) if rng.random() < 0.5 else max(1, H // 2)
    sigma = float(rng.choice([0.0, 0.1, 0.25, 0.5, 0.8]))  # rad/s of execution noise in this episode
    target = arm.random_target(rng)
    q = arm.random_start(rng, target)
    ids: list[int] = []
    query: list[int] = []
    act: list[bool] = []

    def put(tokens: list[int], owner: int, action: bool) -> None:
        ids.extend(tokens)
        query.extend([owner] * len(tokens))
        act.extend([action] * len(tokens))

    put(codec.prompt_ids(tokenize(str(rng.choice(PROMPTS)))), -1, False)
    since, reached_at = 0, None
    for _ in range(queries):
        state = arm.state_vector(q, target)
        chunk = arm.expert_chunk(q, target, H)  # [H, 2] the label
        start = len(ids)
        put(codec.state_ids(state), start, False)
        put(codec.action_tokens(chunk), start, True)
        kick = rng.random() < 0.05  # now and then a burst of random commands: states far off the expert's path
        for h in range(replan):
            qd = chunk[h] + rng.normal(0.0, sigma, 2)
            if kick:
                qd = rng.uniform(-arm.QD_MAX, arm.QD_MAX, 2)
            q = arm.step(q, qd)
            since += 1
            if reached_at is None and np.linalg.norm(arm.hand(q) - target) <= arm.TOLERANCE:
                reached_at = since
        if (reached_at is not None and since >= reached_at + int(rng.integers(0, 30))) or since >= arm.TIME_LIMIT:
            target, since, reached_at = arm.random_target(rng), 0, None
            if rng.random() < 0.05:  # a new instruction mid-episode (the server appends it on change)
                put(codec.prompt_ids(tokenize(str(rng.choice(PROMPTS)))), -1, False)
    return Stream(np.asarray(ids, dtype=np.int64), np.asarray(query, dtype=np.int64), np.asarray(act, dtype=bool),
                  replan)


def kept(end: int, sinks: int, window: int) -> np.ndarray:
    """The stream positions a rolling session of length `end` attends to: [0, sinks) and the last `window`."""
    a, lo = min(sinks, end), max(sinks, end - window)
    return np.concatenate([np.arange(a), np.arange(max(lo, a), end)])


def crop(stream: Stream, end: int, sinks: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """What the session holds when producing token end - 1: -> (input ids [T], labels [T] with -100 where no
    loss: non-action tokens, and action tokens cut off from their query's observation by the window's gap)."""
    keep = kept(end, sinks, window)
    a, lo = min(sinks, end), max(sinks, end - window)
    ids = stream.ids[keep]
    intact = (lo <= a) | (stream.query[keep] >= lo) | (keep < a)  # no kept token between the obs and this one
    target = stream.is_action[keep] & intact
    # the label of position i is the token at i + 1 (causal LM): shift left
    labels = np.full(len(keep), -100, dtype=np.int64)
    labels[:-1] = np.where(target[1:], ids[1:], -100)
    return ids, labels


def training_crop(streams: list[Stream], i: int, end: int, sinks: int, window: int, n_act: int,
                  rng: np.random.Generator, dims: int = 2, prefix_share: float = 0.0, prefix_noise: float = 0.0,
                  action_id_range: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A training example: stream i as a rolling session holds it at the end of a reply, with a history of random
    length up to the window, the loss on that last reply only, and every earlier reply in the crop swapped for an
    expert chunk of a random other state. Why: the real previous chunk predicts the next one so well (commands
    are smooth) that a model trained on it learns to copy its own history instead of reading the state, and then
    drifts in closed loop (the copycat problem). Swapped chunks look like real replies yet say nothing about this
    state, so the model learns to ignore past actions and act on the latest observation, as the expert does.

    With probability `prefix_share` the last reply starts with a forced prefix, as real-time chunking sends it (the
    rows the robot executes while the chunk is computed): its first k rows (1 <= k < H) are the previous query's
    chunk moved on by the steps between them, with no loss on them, each id moved by Gaussian noise of
    `prefix_noise` bins (kept in `action_id_range`, [first, last] action id). Without this a model copies a forced
    prefix into the rest of its chunk; with it, it learns to finish the chunk from the state: at run time the prefix
    is its own earlier guess, errors included, which the noise stands for."""
    st = streams[i]
    last = int(st.query[end - 1])  # the <obs> position of the reply the loss is on
    need = end - last  # its observation and reply, kept whole
    keep = kept(end, sinks, int(rng.integers(min(need, window), window + 1)))
    ids = st.ids[keep].copy()
    owner = st.query[keep]
    past = st.is_action[keep] & (owner != last)
    for q in np.unique(owner[past]):  # one random chunk per earlier reply, laid over its step-major positions
        j = int(rng.integers(len(streams)))
        e = int(rng.choice(query_ends(streams[j])))
        fake = streams[j].ids[e - n_act:e]
        at = np.flatnonzero(past & (owner == q))
        ids[at] = fake[keep[at] - (q + need - n_act)]  # the reply of the query at q starts after its observation
    labels = np.full(len(ids), -100, dtype=np.int64)
    mine = np.flatnonzero(st.is_action[keep] & (owner == last))
    labels[mine - 1] = ids[mine]  # causal LM: position i predicts token i + 1
    prev = st.query[(st.query >= 0) & (st.query < last)]
    if len(prev) and rng.random() < prefix_share:
        old = st.ids[(st.query == prev.max()) & st.is_action]  # the previous chunk's H*D ids, step-major
        shifted = np.concatenate([old[st.replan * dims:], np.tile(old[-dims:], min(st.replan, n_act // dims))])
        k = int(rng.integers(1, n_act // dims)) * dims
        forced = shifted[:k]
        if prefix_noise:
            if action_id_range is None:
                raise ValueError("prefix_noise needs action_id_range, the first and last action ids")
            forced = np.clip(forced + np.rint(rng.normal(0.0, prefix_noise, k)).astype(np.int64), *action_id_range)
        ids[mine[:k]] = forced
        labels[mine[:k] - 1] = -100
    return ids, labels


def query_ends(stream: Stream) -> np.ndarray:
    """Stream lengths at which a query's reply is complete (good crop ends: the engine has just decoded it)."""
    a = stream.is_action
    return np.flatnonzero(a & ~np.append(a[1:], False)) + 1
