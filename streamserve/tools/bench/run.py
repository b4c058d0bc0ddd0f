"""A bench run: probes, every session at once on its own clock, the server sampled every second, a progress bar
on stderr, and the report (a JSON-able dict)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict
from typing import Any

from tqdm import tqdm

from streamserve.errors import StreamserveError
from streamserve.tools.bench import policy, text, voice
from streamserve.tools.bench.config import BenchConfig
from streamserve.tools.bench.record import SessionRecord, code_of, summarise
from streamserve.tools.bench.server import ServerWatch, sample_every_second
from streamserve.version import __version__

log = logging.getLogger("streamserve.bench")

KINDS = ("text", "voice", "policy")
SETTLE_S = 0.5  # after the last session closed, before the server's final figures (its pages come back)
GRACE_S = 30.0  # past duration + turn timeout, a session still running is cancelled (and counted as an error)


class BenchError(StreamserveError):
    """The run could not start (the server is unreachable, refuses the key, ...)."""


async def run_bench(cfg: BenchConfig, key: str | None) -> dict[str, Any]:
    policy_url = cfg.policy_url or cfg.url
    watches = [ServerWatch(cfg.url, key, cfg.server_pid)]
    if cfg.policy and policy_url != cfg.url:
        watches.append(ServerWatch(policy_url, key, None))
    for w in watches:
        try:
            await w.start()
        except Exception as e:
            await w.close()
            raise BenchError(f"cannot load {w.url}: {code_of(e)}: {e}") from None
    try:
        return await load(cfg, key, policy_url, watches)
    finally:
        for w in watches:
            await w.close()


async def load(cfg: BenchConfig, key: str | None, policy_url: str, watches: list[ServerWatch]) -> dict[str, Any]:
    skipped: dict[str, str] = {}
    utts: list[voice.Utterance] = []
    try:
        if cfg.voice:
            found = await asyncio.to_thread(voice.synthesize)  # before any clock runs: Piper takes a while
            reason = found if isinstance(found, str) else await voice.probe(cfg.url, key, cfg.voice_reply_tokens)
            if reason is not None:
                skipped["voice"] = reason
            elif not isinstance(found, str):
                utts = found
        if cfg.policy and (reason := await policy.probe(policy_url, key)) is not None:
            skipped["policy"] = f"{reason} (give a policy server's URL as --policy-url)"
    except Exception as e:  # the server refused or dropped a probe's connection: nothing to measure
        raise BenchError(f"a probe of the server failed: {code_of(e)}: {e}") from None
    for kind, why in skipped.items():
        print(f"streamserve bench: skipping the {kind} sessions: {why}", file=sys.stderr)

    counts = {"text": cfg.text, "voice": cfg.voice, "policy": cfg.policy}
    records = {k: [SessionRecord(k, i) for i in range(counts[k])] for k in KINDS if k not in skipped}
    everyone = [r for rs in records.values() for r in rs]
    load0, wall0 = os.getloadavg()[0], time.monotonic()
    t0 = wall0 + 0.1
    jobs: list[Awaitable[None]] = []
    for n, rec in enumerate(everyone):  # starts spread over one chunk period: not every connection at once
        start = t0 + cfg.chunk_ms / 1000 * n / max(1, len(everyone))
        if rec.kind == "text":
            jobs.append(guarded(rec, text.text_session(cfg, key, rec, start)))
        elif rec.kind == "voice":
            jobs.append(guarded(rec, voice.voice_session(cfg, key, utts, rec, start)))
        else:
            jobs.append(guarded(rec, policy.policy_session(cfg, policy_url, key, rec, start)))

    bar = tqdm(total=round(cfg.duration), unit="s", file=sys.stderr, desc="streamserve bench",
               disable=True if cfg.no_progress else None, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}")

    def tick(t: float, samples: list[dict[str, Any]]) -> None:
        bar.update(min(bar.total, round(t)) - bar.n)
        s = samples[0]
        bar.set_postfix_str(f"sessions {sum(r.started and not r.completed for r in everyone)}, "
                            f"missed {sum(r.missed for r in everyone)}, "
                            f"errors {sum(sum(r.errors.values()) for r in everyone)}, "
                            f"pages {s.get('kv_pages_used', '?')}, rss {s.get('rss_mb') or '?'} MB")

    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_every_second(watches, t0, stop, tick))
    try:
        await asyncio.wait_for(asyncio.gather(*jobs), cfg.duration + cfg.chunk_ms / 1000 + cfg.turn_timeout + GRACE_S)
        bar.update(bar.total - bar.n)  # every session ran its duration (the sampler may not have ticked last)
    except asyncio.TimeoutError:
        for rec in everyone:
            if not rec.completed:
                rec.error("bench_timeout")  # gather cancelled it: a call hung past every timeout
    finally:
        stop.set()
        with contextlib.suppress(BaseException):
            await sampler
        bar.close()
    wall = time.monotonic() - wall0
    await asyncio.sleep(SETTLE_S)
    for w in watches:
        await w.finish()
    return report(cfg, policy_url, records, skipped, watches, wall, load0)


async def guarded(rec: SessionRecord, job: Awaitable[None]) -> None:
    """A session's job; a failure its own handling did not expect is its error (by exception type), never the
    end of the run."""
    try:
        await job
    except Exception as e:
        rec.error(code_of(e))
        log.warning("streamserve bench: %s session %d failed", rec.kind, rec.index, exc_info=True)


def report(cfg: BenchConfig, policy_url: str, records: dict[str, list[SessionRecord]], skipped: dict[str, str],
           watches: list[ServerWatch], wall: float, load0: float) -> dict[str, Any]:
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        n = getattr(cfg, kind)
        if kind in skipped:
            kinds[kind] = {"sessions": n, "held": 0, "skipped": skipped[kind]}
        elif n:
            kinds[kind] = summarise(records[kind])
    errors: collections.Counter[str] = collections.Counter()
    for k in kinds.values():
        errors.update(k.get("errors", {}))
    servers = [w.summary() for w in watches]
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("key", "report", "no_progress", "strict")}
    return {
        "benchmark": "streamserve bench", "version": __version__,
        "started_utc": (datetime.datetime.now(datetime.timezone.utc)
                        - datetime.timedelta(seconds=wall)).isoformat(timespec="seconds"),
        "settings": {**settings, "policy_url": policy_url}, "cpu_count": os.cpu_count(),
        "load_avg_1m": {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)}, "wall_s": round(wall, 1),
        "held": {k: v["held"] for k, v in kinds.items()},
        "all_held": all(v["held"] == v["sessions"] for v in kinds.values()),
        "missed_deadlines": {k: v.get("missed_deadlines") for k, v in kinds.items()},  # None: skipped
        "errors": dict(sorted(errors.items())),
        "shed_chunks": {"acked_as_shed": kinds.get("text", {}).get("counts", {}).get("shed", 0),
                        "server": [s["chunks_shed"] for s in servers]},
        "kinds": kinds, "servers": servers,
    }
