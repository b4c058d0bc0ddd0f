"""Robot policy loops on `WS /v1/policy` (streamserve-client's PolicyClient), at --policy-hz (50) in real time.

Each loop drives the simulated two-link arm (streamserve.robot.arm) through seeded episodes back to back, one
connection for all of them (an episode's first observation carries `reset`: a new session on the server). It
ticks every 1 / --policy-hz s (20 ms at 50 Hz) and never waits for the policy: every --policy-replan ticks
(default half the action chunk H) it sends the observation with its step and a deadline of H - 1 ticks (the
reply's chunk still has a row left to run then) and executes the rows queued for each tick (streamserve-client's
ActionQueue, latest chunk first); a stale reply (the server's answer at the deadline) carries the last chunk's
rows still ahead, which stay queued.

Every tick is a deadline for an action. A missed deadline: a tick with no row to execute (the last chunk ran
out before the next arrived), except the ticks of an episode before its first observation's deadline
(no policy can answer sooner). Measures (ms): `action_ms` (observation sent -> reply), `fresh_action_ms` (replies
that were not stale), `server_infer_ms` (the reply's server_timing). Counts: ticks, startup ticks, held ticks
(no action, startup included), stale replies, replies, episodes, successes, client_late_ticks (this process
ran a tick more than a period late: the load generator itself fell behind, not the server).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from streamserve.robot import arm
from streamserve.tools.bench.config import PROBE_TIMEOUT_S, BenchConfig
from streamserve.tools.bench.record import SessionRecord, code_of, wind_down
from streamserve_client import StreamserveClientError
from streamserve_client.actions import ActionQueue
from streamserve_client.policy import PolicyClient

SKIP_CODES = ("no_policy", "unsupported_observation")  # the served model cannot be a policy: the kind is skipped


async def probe(url: str, key: str | None) -> str | None:
    """None when `url` serves a policy; else why the policy sessions are skipped (the server's own words)."""
    client = PolicyClient(url, api_key=key)
    try:
        await asyncio.wait_for(client.connect(), PROBE_TIMEOUT_S)
    except StreamserveClientError as e:
        if e.code in SKIP_CODES:
            return f"{e.code}: {e.message}"
        raise
    finally:
        await client.close()
    return None


async def policy_session(cfg: BenchConfig, url: str, key: str | None, rec: SessionRecord, start: float) -> None:
    """One control loop from monotonic time `start` for cfg.duration seconds; its figures go to `rec`."""
    client = PolicyClient(url, api_key=key)
    pending: asyncio.Task[dict[str, Any]] | None = None
    try:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        meta = await asyncio.wait_for(client.connect(), cfg.turn_timeout)
        horizon = int(meta["action_horizon"])
        replan = cfg.policy_replan or max(1, horizon // 2)
        period = 1.0 / cfg.policy_hz
        deadline_ms = max(1, horizon - 1) * period * 1e3
        startup = int(np.ceil(deadline_ms / 1e3 / period))  # ticks before the first reply is due
        rec.started = True
        t0, seed = time.monotonic(), 300_000 + 1_000 * rec.index
        q, target = arm.episode_start(seed)
        queue = ActionQueue()  # joint velocities [2] by episode tick
        ep_tick, asked_at, episode_first = 0, -replan, True
        tick = 0
        while (due := t0 + tick * period) < t0 + cfg.duration:
            late = time.monotonic() - due
            if late < 0:
                await asyncio.sleep(-late)
            elif late > period:
                rec.counts["client_late_ticks"] += 1
            if pending is not None and pending.done():
                reply, pending = pending.result(), None
                if len(reply["actions"]):  # a stale reply's rows are the last chunk's still ahead
                    queue.add(reply["actions"], int(reply["valid_from_step"]))
            if pending is None and ep_tick - asked_at >= replan:
                obs = {**arm.observation(q, target), "step": ep_tick, "deadline_ms": deadline_ms}
                if episode_first:
                    obs["reset"], episode_first = True, False
                pending = asyncio.create_task(ask(client, obs, rec, cfg.turn_timeout))
                asked_at = ep_tick
            qd = queue.pop(ep_tick)
            if qd is None:
                qd = np.zeros(2)
                rec.counts["held_ticks"] += 1
                if ep_tick < startup:
                    rec.counts["startup_ticks"] += 1
                else:
                    rec.missed += 1
            q = arm.step(q, qd)
            rec.counts["ticks"] += 1
            tick, ep_tick = tick + 1, ep_tick + 1
            success = bool(np.linalg.norm(arm.hand(q) - target) <= arm.TOLERANCE)
            if success or ep_tick >= arm.TIME_LIMIT:  # the next episode: a new session on the server
                rec.counts["episodes"] += 1
                rec.counts["successes"] += success
                if pending is not None:  # its answer belongs to this episode: read it before the reset
                    await pending
                    pending = None
                seed += 1
                q, target = arm.episode_start(seed)
                queue = ActionQueue()
                ep_tick, asked_at, episode_first = 0, -replan, True
        if pending is not None:
            await pending
        rec.completed = True
    except (StreamserveClientError, asyncio.TimeoutError, OSError) as e:
        rec.error(code_of(e))
    finally:
        await wind_down(pending, client.close)


async def ask(client: PolicyClient, obs: dict[str, Any], rec: SessionRecord, timeout: float) -> dict[str, Any]:
    """Send one observation and read its reply; the latencies go to `rec`."""
    sent = time.monotonic()
    await client.send(obs)
    reply = await asyncio.wait_for(client.receive(), timeout)
    seconds = time.monotonic() - sent
    rec.latency("action_ms", seconds)
    rec.counts["replies"] += 1
    if reply.get("stale"):
        rec.counts["stale_replies"] += 1
    else:
        rec.latency("fresh_action_ms", seconds)
    infer = (reply.get("server_timing") or {}).get("infer_ms")
    if isinstance(infer, (int, float)):
        rec.latencies["server_infer_ms"].append(float(infer))
    return reply
