"""Drive the simulated two-link arm at 50 Hz with streamserve's robot policy endpoint, and print the success rate.

    streamserve serve --model default-policy --policy-port 8001     # one terminal: the trained default policy
    python examples/robot_loop.py                                   # the native SDK (streamserve-client)
    python examples/robot_loop.py --client openpi --url ws://127.0.0.1:8001   # openpi-client, unchanged

Each episode is one session on the server (the first observation carries `reset`). The control loop ticks at
`--hz` in real time and never waits for the policy: every `--replan` ticks (default half the chunk) it sends the
observation (with its step, so the reply says which tick its chunk starts at) and keeps executing the rows it has
queued (streamserve-client's ActionQueue: row r of a reply is for step `valid_from_step + r`). A reply later than
`--deadline-ms` comes back `stale` at the deadline with the last chunk's rows still ahead, which stay queued; where a
newer chunk overlaps rows still queued, `--blend` says what runs (the newer row, the average of all, or a weighted
average). A tick with no row queued (the chunk ran out before the next arrived) holds still — zero joint velocity —
and counts as held.
`--rtc K` turns on real-time chunking: each observation carries the K rows queued from its tick on (what the arm
executes while the reply is computed) as `action_prefix`, the reply's chunk starts with them and the server decodes
only the other H - K rows, conditioned on them: a shorter reply, and no jump where the new chunk takes over.
`--lockstep` waits for every reply instead (no real time): the result is then deterministic, the same as the
in-process policy's.

The last line is a JSON summary: success rate, latency p50/p99, held and missed ticks, stale replies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamserve.robot import arm
from streamserve_client.actions import ActionQueue

Request = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # observation -> reply (one in flight)


@dataclass
class Episode:
    success: bool = False
    ticks: int = 0
    held: int = 0  # ticks with no row queued: the arm held still
    missed: int = 0  # ticks that ran more than a period late (the loop itself fell behind)
    stale: int = 0  # replies that came back stale (past their deadline)
    latencies_ms: list[float] = field(default_factory=list)  # observation sent -> reply received
    fresh_ms: list[float] = field(default_factory=list)  # the same, replies that were not stale
    forwards: list[int] = field(default_factory=list)  # per fresh reply: the model forwards that made its chunk
    drafted: int = 0  # draft tokens the server verified (its chunk drafted from the last one), and accepted
    accepted: int = 0


async def run_episode(request: Request, seed: int, hz: float = 50.0, replan: int = 5, deadline_ms: float | None = None,
                      lockstep: bool = False, time_limit: int = arm.TIME_LIMIT, blend: str | float = "latest",
                      rtc: int = 0) -> Episode:
    """One seeded episode of the arm against `request`. Real time: the loop sleeps to each tick and sends an
    observation every `replan` ticks without waiting (one in flight); lockstep: it waits for each reply. `rtc`:
    the rows queued from the observation's tick on that it sends as `action_prefix` (at most `rtc`)."""
    q, target = arm.episode_start(seed)
    ep, period = Episode(), 1.0 / hz
    queue = ActionQueue(blend)  # joint velocities [2] by tick, from every reply's chunk
    valid_from: int | None = None  # the tick the last fresh chunk starts at
    pending: asyncio.Task[dict[str, Any]] | None = None
    first = True
    start = time.monotonic()

    def ask(tick: int) -> Coroutine[Any, Any, dict[str, Any]]:
        """The observation of this tick, built now (its action_prefix before the tick's row is popped)."""
        nonlocal first
        obs = {**arm.observation(q, target), "step": tick, "timestamp": time.time()}
        if deadline_ms is not None:
            obs["deadline_ms"] = float(deadline_ms)
        if first:  # a new episode: a new session on the server
            obs["reset"], first = True, False
        elif rtc > 0:  # real-time chunking: the rows it executes meanwhile start the reply's chunk
            prefix = queue.rows(tick, rtc)
            if len(prefix):
                obs["action_prefix"] = prefix.astype(np.float32)
        return reply_to(obs)

    async def reply_to(obs: dict[str, Any]) -> dict[str, Any]:
        sent = time.monotonic()
        reply = await request(obs)
        ms = (time.monotonic() - sent) * 1000  # when it came, not the tick that reads it
        ep.latencies_ms.append(ms)
        timing = reply.get("policy_timing") or {}
        if not reply.get("stale"):
            ep.fresh_ms.append(ms)
            if "forwards" in timing:  # a streamserve server says how its chunk was made
                ep.forwards.append(int(timing["forwards"]))
                ep.drafted += int(timing.get("draft_tokens", 0))
                ep.accepted += int(timing.get("accepted_tokens", 0))
        return reply

    def take(reply: dict[str, Any], tick: int) -> None:
        nonlocal valid_from
        rows = np.asarray(reply["actions"], dtype=np.float64)
        if len(rows):  # a stale reply's rows are the last chunk's still ahead: they stay queued
            queue.add(rows, int(reply.get("valid_from_step", tick)))
        if reply.get("stale"):
            ep.stale += 1  # ask again at once: the observation it answers is old
            return
        valid_from = int(reply.get("valid_from_step", tick))

    try:
        for tick in range(time_limit):
            if not lockstep:
                late = time.monotonic() - (start + tick * period)
                if late < 0:
                    await asyncio.sleep(-late)
                elif late > period:
                    ep.missed += 1
            if pending is not None and pending.done():
                take(pending.result(), tick)
                pending = None
            if pending is None and (valid_from is None or tick - valid_from >= replan):
                if lockstep:
                    take(await ask(tick), tick)
                else:
                    pending = asyncio.create_task(ask(tick))
            qd = queue.pop(tick)
            if qd is None:
                qd, ep.held = np.zeros(2), ep.held + 1  # no row for this tick: hold still
            q = arm.step(q, qd)
            ep.ticks = tick + 1
            if np.linalg.norm(arm.hand(q) - target) <= arm.TOLERANCE:
                ep.success = True
                break
    finally:
        if pending is not None:  # its reply must be read before the next episode's request
            take(await pending, ep.ticks)
    return ep


@dataclass
class Connection:
    request: Request
    close: Callable[[], Awaitable[None]]
    metadata: dict[str, Any]


async def native_connection(url: str, api_key: str | None) -> Connection:
    """streamserve-client's PolicyClient: send, then read the reply (the loop runs one request at a time)."""
    from streamserve_client.policy import PolicyClient

    client = PolicyClient(url, api_key=api_key)
    await client.connect()

    async def request(obs: dict[str, Any]) -> dict[str, Any]:
        await client.send(obs)
        return await client.receive()

    return Connection(request, client.close, client.metadata)


async def openpi_connection(url: str, api_key: str | None) -> Connection:
    """openpi-client's blocking WebsocketClientPolicy, unchanged, on a worker thread (the loop keeps ticking)."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    policy = await asyncio.to_thread(WebsocketClientPolicy, host=url, api_key=api_key)

    async def request(obs: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(policy.infer, obs)

    async def close() -> None:
        await asyncio.to_thread(policy._ws.close)  # openpi-client has no close(); its connection is this attribute

    return Connection(request, close, policy.get_server_metadata())


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def summary(episodes: list[Episode], **extra: Any) -> dict[str, Any]:
    lat = [x for e in episodes for x in e.latencies_ms]
    fresh = [x for e in episodes for x in e.fresh_ms]
    return {"episodes": len(episodes), "success_rate": sum(e.success for e in episodes) / max(1, len(episodes)),
            "latency_ms_p50": round(percentile(lat, 50), 1), "latency_ms_p99": round(percentile(lat, 99), 1),
            "fresh_latency_ms_p50": round(percentile(fresh, 50), 1), "fresh_replies": len(fresh),
            "requests": len(lat), "ticks": sum(e.ticks for e in episodes), "held_ticks": sum(e.held for e in episodes),
            "missed_ticks": sum(e.missed for e in episodes), "stale": sum(e.stale for e in episodes),
            **chunk_costs(episodes), **extra}


def chunk_costs(episodes: list[Episode]) -> dict[str, float | None]:
    """What a streamserve server said about its chunks: forwards per chunk (H*D without a draft) and the share
    of draft tokens accepted (None from a server that does not say)."""
    forwards = [f for e in episodes for f in e.forwards]
    drafted = sum(e.drafted for e in episodes)
    return {"forwards_per_chunk": round(float(np.mean(forwards)), 2) if forwards else None,
            "draft_acceptance": round(sum(e.accepted for e in episodes) / drafted, 3) if drafted else None}


def blend_arg(text: str) -> str | float:
    return text if text in ("latest", "average") else float(text)


def default_replan(metadata: dict[str, Any]) -> int:
    """Half the chunk: the next chunk is asked for while half of this one is still there to execute."""
    return max(1, int(metadata["action_horizon"]) // 2)


def default_deadline_ms(metadata: dict[str, Any], hz: float, replan: int) -> float:
    """While the reply's chunk still has a row to execute: its first row is for the observation's tick, so a reply
    later than H - 1 ticks has nothing left that is not in the past (`replan` does not change this)."""
    return max(1, int(metadata["action_horizon"]) - 1) * 1000.0 / hz


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    connect = openpi_connection if args.client == "openpi" else native_connection
    conn = await connect(args.url, args.api_key)
    replan = args.replan or default_replan(conn.metadata)
    deadline = args.deadline_ms
    if deadline is None and not args.lockstep:
        deadline = default_deadline_ms(conn.metadata, args.hz, replan)
    episodes = []
    try:
        for n in range(args.episodes):
            seed = arm.EVAL_SEEDS[n % len(arm.EVAL_SEEDS)] if args.seed is None else args.seed + n
            e = await run_episode(conn.request, seed, args.hz, replan, deadline, args.lockstep, blend=args.blend,
                                  rtc=args.rtc)
            episodes.append(e)
            print(f"episode {n + 1}/{args.episodes} (seed {seed}): {'reached' if e.success else 'missed'} in "
                  f"{e.ticks} ticks; held {e.held}, stale {e.stale}, p50 {percentile(e.latencies_ms, 50):.0f} ms",
                  flush=True)
    finally:
        await conn.close()
    return summary(episodes, client=args.client, hz=args.hz, replan=replan, lockstep=args.lockstep,
                   deadline_ms=deadline, rtc=args.rtc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/policy",
                   help="the policy endpoint (openpi-client: the --policy-port URL, or this one)")
    p.add_argument("--client", choices=("native", "openpi"), default="native")
    p.add_argument("--api-key", default=None)
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=None, help="first arm seed (default: the evaluation seeds)")
    p.add_argument("--hz", type=float, default=50.0, help="control rate")
    p.add_argument("--blend", type=blend_arg, default="latest",
                   help="where a newer chunk overlaps rows still queued: latest (its rows), average (of every "
                        "chunk's), or a weight in (0, 1] for the newer chunk (default latest)")
    p.add_argument("--replan", type=int, default=None,
                   help="ticks between observations sent (default: half the chunk's horizon)")
    p.add_argument("--deadline-ms", type=float, default=None,
                   help="reply deadline per observation (default: while the reply's chunk has a row left, H - 1 ticks)")
    p.add_argument("--rtc", type=int, default=0, metavar="K",
                   help="real-time chunking: send the K rows queued from each observation's tick on as its "
                        "action_prefix (K < H; default 0, off)")
    p.add_argument("--lockstep", action="store_true", help="wait for every reply (deterministic; not real time)")
    args = p.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
