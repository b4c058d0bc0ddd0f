"""The loaded server's own figures, sampled every second during a bench run.

KV pages, open sessions, queued chunks and shed chunks come from the native protocol's `stats` message (one
extra connection; server-wide figures need the API key when the server has one). The server's resident memory
is not in its stats or /metrics, so it is read from /proc/PID/status (Linux): PID is --server-pid, or the process
that owns the listening socket of the URL's port (found in /proc/net/tcp{,6} and the processes' open files, so it
works only for a server on this machine run by a user whose /proc entries this one can read).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import streamserve_client as sc
from streamserve.tools.bench.config import PROBE_TIMEOUT_S, is_loopback
from streamserve.tools.bench.record import code_of, wind_down

STAT_KEYS = ("kv_pages_used", "kv_pages_total", "sessions_open", "sessions_parked", "queued_chunks", "chunks_shed")
LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp


def listening_pid(port: int) -> int | None:
    """The process listening on TCP `port` on this machine, or None when it cannot be told."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()  # sl local_address rem_address st ... uid timeout inode
                if len(cols) > 9 and cols[3] == LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(proc.name)
    return None


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)  # kB
    return None


class ServerWatch:
    """One server's figures over time: `samples` [{t, rss_mb, kv_pages_used, ...}], t in seconds from the start."""

    def __init__(self, url: str, key: str | None, pid: int | None) -> None:
        self.url, self.key = url, key
        self.client = sc.Client(url, api_key=key, reconnect=False)
        self.samples: list[dict[str, Any]] = []
        self.first: dict[str, Any] = {}  # the figures before the load starts
        self.model: str | None = None
        self.stats_error: str | None = None
        self.after: dict[str, Any] = {}  # the figures once every bench session has closed
        self.pid, self.rss_note = pid, "--server-pid"
        if pid is None:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "wss" else 80)
            self.pid = listening_pid(port) if is_loopback(parts.hostname or "") else None
            self.rss_note = (f"/proc/{self.pid}/status (the process listening on port {port})" if self.pid
                             else "unknown: no process on this machine found listening on the URL's port "
                                  "(give --server-pid)")

    async def start(self) -> None:
        """Connect (the server must be up: its errors go to the caller) and take the figures before the load."""
        await asyncio.wait_for(self.client.connect(), PROBE_TIMEOUT_S)
        self.model = self.client.hello.get("model")
        self.first = await self.stats() or {}

    async def stats(self) -> dict[str, Any] | None:
        if self.stats_error is not None:
            return None
        try:
            st = await asyncio.wait_for(self.client.stats(), PROBE_TIMEOUT_S)
        except (sc.StreamserveClientError, asyncio.TimeoutError, OSError) as e:
            self.stats_error = code_of(e)
            return None
        if "kv_pages_used" not in st:  # a client secret sees the model only
            self.stats_error = "server-wide stats need the API key (--key)"
            return None
        return {k: st.get(k) for k in STAT_KEYS}

    async def sample(self, t: float) -> dict[str, Any]:
        s: dict[str, Any] = {"t": round(t, 1), "rss_mb": rss_mb(self.pid) if self.pid else None}
        s.update(await self.stats() or {})
        self.samples.append(s)
        return s

    async def finish(self) -> None:
        """The figures once the load is over (its sessions closed: their pages should be back), then disconnect."""
        self.after = await self.stats() or {}
        await self.close()

    async def close(self) -> None:
        await wind_down(None, self.client.close)

    def summary(self) -> dict[str, Any]:
        rss = [s["rss_mb"] for s in self.samples if s.get("rss_mb") is not None]
        pages = [s["kv_pages_used"] for s in self.samples if s.get("kv_pages_used") is not None]
        last = self.after or next((s for s in reversed(self.samples) if "chunks_shed" in s), {})
        shed = (last["chunks_shed"] - self.first["chunks_shed"]
                if "chunks_shed" in self.first and last.get("chunks_shed") is not None else None)
        return {"url": self.url, "model": self.model, "pid": self.pid, "rss_source": self.rss_note,
                "stats_error": self.stats_error, "kv_pages_total": self.first.get("kv_pages_total"),
                "rss_mb": {"start": rss[0] if rss else None, "max": max(rss) if rss else None,
                           "end": rss[-1] if rss else None},
                "kv_pages_used": {"start": self.first.get("kv_pages_used"), "max": max(pages) if pages else None,
                                  "end": pages[-1] if pages else None,
                                  "after_close": self.after.get("kv_pages_used")},
                "chunks_shed": shed, "samples": self.samples}


async def sample_every_second(watches: list[ServerWatch], t0: float, stop: asyncio.Event,
                              tick: Any = None) -> None:
    """Sample every watch once a second from monotonic `t0` until `stop`; `tick(t, first samples)` after each."""
    k = 1
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, t0 + k - time.monotonic()))
        if stop.is_set():
            break
        got = [await w.sample(time.monotonic() - t0) for w in watches]
        if tick is not None:
            tick(time.monotonic() - t0, got)
        k += 1
