"""One forward for several sessions' steps: planning each (admission), running them together (a captured
CUDA graph or the eager batched model), committing each, and isolating a session whose step fails.

After a batched forward that raises, every step is undone and each runs alone, so the one that fails is
found and only it fails. Logits are copied per session: a view would keep the whole batch's logits alive.
A step with embedding vectors (an embedding chunk, or a vector position run again after a rewind) runs
eagerly: its rows' vectors replace their placeholder embeddings inside the model's forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from streamserve.engine.admission import Admission
from streamserve.engine.counters import Counters
from streamserve.engine.graphs import DecodeGraphs, graphable, rows_of
from streamserve.engine.guard import BetweenSteps
from streamserve.engine.state import SessionState
from streamserve.models import CausalLM
from streamserve.models.quantize import weight_bytes
from streamserve.sessions import PagedSessionKV

# On a CPU, steps of fewer tokens than this run on one intra-op thread; larger ones keep the process's setting. It is
# the kept step_costs result's `threads_pay_from_tokens` (benchmarks/results/step_costs.json: the step size from
# which every larger one ran faster on all threads; tests/test_benchmarks.py checks the two agree)
CPU_SMALL_STEP_TOKENS = 8
# ...unless the model reads at least this many bytes of weights per token: such a decode is bound by memory
# reads, and more cores read faster (SmolLM2-135M on 2 vCPUs, every weight format: benchmarks/cpu_decode.py)
CPU_WIDE_STEP_BYTES = 32 << 20


@dataclass
class Job:
    """One session's part of a step: `ids` run after its committed tokens; `vectors` (first row in `ids`,
    vectors [n, hidden] or one vector [hidden]) replace those rows' embeddings; `all_rows`: keep the logits of
    every row (draft verification)."""

    state: SessionState
    ids: list[int]
    vectors: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    all_rows: bool = False


class BatchForward:
    def __init__(self, model: CausalLM, admission: Admission, counters: Counters, guard: BetweenSteps) -> None:
        self.model, self.admission, self.counters, self.guard = model, admission, counters, guard
        self.device = next(model.parameters()).device
        self.wide = sum(weight_bytes(model).values()) >= CPU_WIDE_STEP_BYTES  # every step on all threads
        self.graphs: DecodeGraphs | None = None  # CUDA-graph decode, when on
        self.seconds: float | None = None  # the last step's forward time (None: no forward, or a graph captured)

    def run(self, jobs: list[Job]) -> list[torch.Tensor | BaseException]:
        """Each job's ids run after its session's committed tokens, all in one forward. -> per job the logits
        [V] of its last token ([T, V] of all its tokens where `all_rows`: draft verification), or the
        exception that failed it (that job's step is undone; the others are unaffected). Verification jobs
        are committed without dropping pages outside the window: the caller truncates the rejected drafts
        first, then drops them (`kv.drop_outside_window()`)."""
        self.seconds = None
        with self.guard:
            busy = [j.state.kv for j in jobs]
            out: list[torch.Tensor | BaseException | None] = [None] * len(jobs)
            ready = [i for i in range(len(jobs)) if self._try_begin(jobs[i], busy, out, i)]
            try:
                logits = self._forward_jobs([jobs[i] for i in ready]) if ready else None
            except Exception as e:
                for i in ready:
                    jobs[i].state.kv.abort()
                if len(ready) == 1:
                    out[ready[0]] = e
                else:
                    for i in ready:  # find the job that fails: each runs alone
                        if self._try_begin(jobs[i], busy, out, i):
                            try:
                                out[i] = self._forward_jobs([jobs[i]])[0].clone()
                                jobs[i].state.kv.commit(drop=not jobs[i].all_rows)
                            except Exception as e1:
                                jobs[i].state.kv.abort()
                                out[i] = e1
            else:
                for rows, i in zip(logits or [], ready, strict=True):
                    jobs[i].state.kv.commit(drop=not jobs[i].all_rows)
                    out[i] = rows.clone()  # a view would keep the whole batch's logits alive
        return out  # type: ignore[return-value]

    def _try_begin(self, job: Job, busy: list[PagedSessionKV], out: list[torch.Tensor | BaseException | None],
                   i: int) -> bool:
        try:
            self.admission.begin_step(job.state, job.state.kv, len(job.ids), busy)
            return True
        except Exception as e:
            out[i] = e
            return False

    def _forward_jobs(self, jobs: list[Job]) -> list[torch.Tensor]:
        return self.forward_planned([j.state.kv for j in jobs], [j.ids for j in jobs], [j.all_rows for j in jobs],
                                    [j.vectors for j in jobs])

    def forward_planned(self, kvs: list[PagedSessionKV], ids: list[list[int]], all_rows: list[bool] | None = None,
                        vectors: list[list[tuple[int, torch.Tensor]]] | None = None) -> list[torch.Tensor]:
        """The planned (`begin`) steps of `kvs` over `ids` in one forward -> per session the logits of its last
        token [V], or of all its tokens [T, V] where `all_rows`. `vectors[i]`: (row of ids[i], vector
        [hidden]) embeddings that replace those rows'. The caller commits or aborts."""
        widths = [len(i) for i in ids]
        flags = all_rows or [False] * len(ids)
        override = flat_vectors(widths, vectors, self.device) if vectors and any(vectors) else None
        t0 = time.perf_counter()
        graphs = self.graphs
        captured = graphs.captured if graphs is not None else 0
        with threads_for(self.device, sum(widths), self.wide):
            logits = None  # embedding steps (appends) are not graph widths' work: they always run eagerly
            if graphs is not None and override is None and graphable(widths):
                logits = graphs.run(kvs, ids, flags)  # None: a window policy graphs do not serve now
            if logits is None:
                flat = torch.tensor([t for i in ids for t in i], dtype=torch.long, device=self.device)
                rows = None if all(flags) else rows_of(widths, flags)
                logits = (self.model.forward_batch(flat, kvs, rows) if override is None
                          else self.model.forward_batch(flat, kvs, rows, embeds=override))
        seconds = time.perf_counter() - t0
        self.counters.count_forward(widths, seconds)
        # a step that captured a graph took capture time too: it measures nothing about the step's cost
        self.seconds = None if graphs is not None and graphs.captured != captured else seconds
        out, start = [], 0
        for w, f in zip(widths, flags, strict=True):  # split the rows per session
            n = w if f else 1
            out.append(logits[start:start + n] if f else logits[start])
            start += n
        return out


def flat_vectors(widths: list[int], vectors: list[list[tuple[int, torch.Tensor]]], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-session (first row, vectors [n, hidden] or [hidden]) lists -> (rows [R] in the flat step, vectors
    [R, hidden] on `device`) for the model. A vector may be on the host: a parked session's are, and the step
    gathered them before its admission brought the session back."""
    rows: list[int] = []
    values: list[torch.Tensor] = []
    start = 0
    for w, vs in zip(widths, vectors, strict=True):
        for r, v in vs:
            block = v if v.dim() == 2 else v[None]
            rows.extend(range(start + r, start + r + block.shape[0]))
            values.append(block.to(device))  # a no-op unless the vector is on the host
        start += w
    return torch.tensor(rows, dtype=torch.long, device=device), torch.cat(values)


@contextlib.contextmanager
def threads_for(device: torch.device, tokens: int, wide: bool = False) -> Iterator[None]:
    """A small CPU step of a small model runs on one intra-op thread; the process's setting is restored after."""
    prev = torch.get_num_threads()
    if device.type != "cpu" or wide or tokens >= CPU_SMALL_STEP_TOKENS or prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
