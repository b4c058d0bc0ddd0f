"""Prometheus metrics of one engine, in its own registry (the server exposes it at /metrics).

Observed by the engine loop after every step: step time, tokens per step by kind, queue depths,
per-chunk append latency, time to first token, inter-token latency, KV pages (in all and per layer group),
sessions, shed chunks.
Gauges of pool and sessions are read when scraped, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from streamserve.engine.work import ChunkAcked, Event, Plan, SessionFailed, StepOutput, TokenProduced

if TYPE_CHECKING:
    from streamserve.sessions.pool import PageAllocator

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class EngineMetrics:
    def __init__(self, pages: PageAllocator, sessions_open: Callable[[], int], sessions_parked: Callable[[], int]
                 ) -> None:
        """`pages`: the KV pool's allocator; the two callables count the engine's sessions when scraped."""
        self.registry = r = CollectorRegistry()
        self.step_seconds = Histogram("streamserve_step_seconds", "Wall time of one engine step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram("streamserve_step_tokens", "Tokens run in one engine step, by kind of work",
                                     ["kind"], buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("streamserve_tokens", "Tokens processed, by kind of work", ["kind"], registry=r)
        self.append_latency = Histogram("streamserve_append_latency_seconds",
                                        "From a chunk's submission to its ack (in the KV cache)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("streamserve_time_to_first_token_seconds",
                              "From a reply's request to its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("streamserve_inter_token_latency_seconds", "Between consecutive tokens of a reply",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.deadline_missed = Counter("streamserve_chunks_deadline_missed", "Chunks acked after their deadline",
                                       registry=r)
        self.shed = Counter("streamserve_chunks_shed", "Chunks dropped under overload (video only)", registry=r)
        self.failed = Counter("streamserve_sessions_failed", "Sessions closed by a fault in their step",
                              registry=r)
        self.drafts = Counter("streamserve_draft_tokens", "Drafted tokens by drafter, proposed and accepted",
                              ["drafter", "outcome"], registry=r)
        self.queue_depth = Gauge("streamserve_queue_depth", "Work waiting in the scheduler, by kind", ["kind"],
                                 registry=r)
        Gauge("streamserve_kv_pages_used", "KV pages in use", registry=r).set_function(lambda: pages.used_count)
        Gauge("streamserve_kv_pages_total", "KV pages in the pool", registry=r).set_function(lambda: pages.num_pages)
        # per layer group (one unless the model mixes native windows, e.g. Gemma 3's local and global layers)
        used = Gauge("streamserve_kv_group_pages_used", "KV pages in use per layer group", ["group"], registry=r)
        total = Gauge("streamserve_kv_group_pages_total", "KV pages per layer group", ["group"], registry=r)
        for g in range(len(pages.group_pages)):
            used.labels(str(g)).set_function(lambda g=g: pages.used_in(g))
            total.labels(str(g)).set_function(lambda g=g: pages.group_pages[g])
        Gauge("streamserve_sessions_open", "Open sessions (parked included)", registry=r).set_function(sessions_open)
        Gauge("streamserve_sessions_parked", "Sessions whose KV is offloaded to host memory",
              registry=r).set_function(sessions_parked)

    def observe_draft(self, drafter: str, proposed: int, accepted: int) -> None:
        self.drafts.labels(drafter, "proposed").inc(proposed)
        self.drafts.labels(drafter, "accepted").inc(accepted)

    def observe_step(self, plan: Plan, out: StepOutput, events: list[Event], depths: dict[str, int]) -> None:
        self.step_seconds.observe(out.finished - out.started)
        for kind in ("append", "decode"):
            n = sum(i.n_tokens for i in plan.items if i.kind == kind)
            if n:
                self.step_tokens.labels(kind).observe(n)
                self.tokens.labels(kind).inc(n)
        for name, value in depths.items():
            self.queue_depth.labels(name).set(value)
        per_step: dict = {}  # response -> tokens it produced in this step
        for e in events:
            if isinstance(e, ChunkAcked):
                if e.ack.shed:
                    self.shed.inc()
                    continue
                self.append_latency.observe(out.finished - e.chunk.arrival)
                if e.ack.deadline_missed:
                    self.deadline_missed.inc()
            elif isinstance(e, TokenProduced):
                per_step[e.response] = per_step.get(e.response, 0) + 1
            elif isinstance(e, SessionFailed):
                self.failed.inc()
        for r, n in per_step.items():  # a verification step emits several tokens: they share its latency
            if r.prev_token_at is None:
                self.ttft.observe(out.finished - r.arrival)
            else:
                for _ in range(n):
                    self.itl.observe((out.finished - r.prev_token_at) / n)

    def exposition(self, prefix: str = "streamserve_") -> bytes:
        """The Prometheus text format of every metric, named `prefix`... (a second engine beside the main one, e.g.
        --policy-model's, is exposed as `streamserve_policy_*` on the same /metrics)."""
        return generate_latest(self.registry if prefix == "streamserve_" else _Renamed(self.registry, prefix))


class _Renamed:
    """A registry's metrics with `streamserve_` in their names (and their samples') swapped for another prefix."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry, self.prefix = registry, prefix

    def collect(self) -> Iterator[Metric]:
        def name(n: str) -> str:
            return self.prefix + n.removeprefix("streamserve_")

        for m in self.registry.collect():
            out = Metric(name(m.name), m.documentation, m.type, m.unit)
            out.samples = [type(s)(name(s.name), *s[1:]) for s in m.samples]  # a Sample is a named tuple
            yield out
