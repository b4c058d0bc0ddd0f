"""How many threads the engine and each voice model may use: one explicit budget over the cores this process may
run on.

The cores: the CPUs the process is allowed (its affinity), capped by a cgroup CPU quota where there is one (a
container given 2 CPUs on a 64-core host reports 64 from os.cpu_count(); sizing every pool by that would run
dozens of threads on 2 cores, each pool's spinning workers stealing the others' time).

The split (`plan`), for C cores:
    engine       C intra-op threads for torch (capped at start by apply_engine_threads: torch sizes its pool by
                 the affinity and ignores a quota); a step of fewer than 64 tokens (every decode step at the batch
                 sizes a voice server sees) runs on one of them (engine/batch.py, threads_for)
    stt          C threads for Whisper (CTranslate2): passes run one batch at a time for the whole server
                 (server/media/voice/stt_scheduler.py), mostly while the person speaks, when the engine is idle
    tts          max(1, C // 2) threads per Piper synthesis (onnxruntime), and max(2, C // 2) syntheses at once on
                 the media executor: the engine decodes beside them
    vad          1 thread (Silero on the per-frame thread: ~0.2 ms per 32 ms window)
onnxruntime's pools are told not to spin (`session.intra_op.allow_spinning`
0): an idle Piper or Silero pool then sleeps at once instead of spinning next to the engine.
VoiceRuntime.load(threads=N) gives every model N threads instead.

Why the sum may exceed C: the stages mostly take turns (Whisper while the person speaks, the engine and Piper
while the reply is made), and a stage held to a fraction of the cores is slower when it runs alone. Measured on 2
cores with eight voice sessions: Whisper on one thread instead of two made first audio later (3.2 s p50 against
1.9-2.5 s), and the engine's steps there are one-thread steps already. Where they would fight, the schedulers give
way instead: partial transcripts wait while speech is synthesised (server/media/voice/stt_scheduler.py).
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
    cores: int  # also the engine's torch threads
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

    @property
    def engine(self) -> int:
        """torch's intra-op threads (steps under 64 tokens use one)."""
        return self.cores

    def describe(self) -> str:
        return (f"{self.cores} cores: engine {self.engine} threads (1 for small steps), speech to text {self.stt}, "
                f"text to speech {self.tts} per synthesis x {self.tts_workers}, VAD {self.vad}")


def apply_engine_threads(budget: ThreadBudget | None = None) -> int:
    """Cap torch's intra-op threads at the budget's engine share -> the count now in force. Only ever lowers it:
    torch sizes its pool by the CPUs in the affinity mask, so in a container held to 2 CPUs by a quota on a
    64-core host it would run 64 threads on 2 CPUs' time; a lower count the user chose (OMP_NUM_THREADS,
    torch.set_num_threads) is kept."""
    import torch

    cap = (budget or ThreadBudget.plan()).engine
    if torch.get_num_threads() > cap:
        torch.set_num_threads(cap)
    return torch.get_num_threads()


__all__ = ["ThreadBudget", "apply_engine_threads", "available_cores", "cgroup_cpus"]
