"""How many threads each voice model may use: one explicit budget over the cores this process may run on.

The cores: the CPUs the process is allowed (its affinity), capped by a cgroup CPU quota where there is one (a
container given 2 CPUs on a 64-core host reports 64 from os.cpu_count(); sizing every pool by that would run
dozens of threads on 2 cores, each pool's spinning workers stealing the others' time).

The split (`plan`), for C cores:
    stt          C threads for Whisper (CTranslate2): passes run one batch at a time for the whole server
                 (server/voice/stt_scheduler.py), mostly while the person speaks, when the engine is idle
    tts          max(1, C // 2) threads per Piper synthesis (onnxruntime), and max(2, C // 2) syntheses at once on
                 the media executor: the engine decodes beside them
    vad          1 thread (Silero on the per-frame thread: ~0.2 ms per 32 ms window)
The engine keeps torch's own threads. onnxruntime's pools are told not to spin (`session.intra_op.allow_spinning`
0): an idle Piper or Silero pool then sleeps at once instead of spinning next to the engine.
VoiceRuntime.load(threads=N) gives every model N threads instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")  # "max 100000" or "<quota> <period>"


def cgroup_cpus(path: Path = CGROUP_V2) -> float | None:
    """The CPUs a cgroup v2 quota allows (quota / period), or None without one."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(0.0, int(quota) / int(period)) or None
    except (ValueError, ZeroDivisionError):
        return None


def available_cores(quota_file: Path = CGROUP_V2) -> int:
    """The cores this process may use: its affinity, capped by a cgroup quota (rounded up), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpus(quota_file)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


@dataclass(frozen=True)
class ThreadBudget:
    cores: int
    stt: int  # Whisper's threads
    tts: int  # threads per Piper synthesis
    tts_workers: int  # Piper syntheses at once (the media executor's threads)
    vad: int = 1

    @classmethod
    def plan(cls, cores: int | None = None, threads: int | None = None) -> ThreadBudget:
        """The split for `cores` (default: available_cores()); `threads`: every model that many instead."""
        c = cores or available_cores()
        if threads:
            return cls(c, threads, threads, max(2, threads))
        half = max(1, c // 2)
        return cls(c, c, half, max(2, half))

    def describe(self) -> str:
        return (f"{self.cores} cores: speech to text {self.stt} threads, text to speech {self.tts} per synthesis "
                f"x {self.tts_workers}, VAD {self.vad}")


__all__ = ["ThreadBudget", "available_cores", "cgroup_cpus"]
