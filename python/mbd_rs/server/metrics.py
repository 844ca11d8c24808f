"""What a server exposes to be watched: `/metrics` in Prometheus' text format (prometheus_client, one registry an
app), with the counters and histograms of its requests (`Metrics.request`, `Metrics.answered`) and the gauges read
from its engine and slots at each scrape; and `fingerprint`, the `system_fingerprint` of its responses."""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import __version__ as version

if TYPE_CHECKING:
    from ..engine import Engine
    from ..types import StreamChunk
    from .slots import Slots

#: The routes counted by name; any other path is counted as "other" (a scanner's paths must not grow the label set).
ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenizer_info",
          "/tokenize", "/detokenize")

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Live(Collector):
    """The values read at each scrape: the admission slots and the engine's own counters."""

    def __init__(self, engine: "Engine", slots: "Slots", batch: int):
        self.engine, self.slots, self.batch = engine, slots, batch

    def collect(self) -> Iterator[Any]:
        active = self.slots.active
        yield GaugeMetricFamily("mbd_active_generations", "Generations holding a slot (batched or queued)",
                                value=active)
        yield GaugeMetricFamily("mbd_queued_generations", "Generations waiting for a place in the batch",
                                value=max(0, active - self.batch))
        yield GaugeMetricFamily("mbd_generation_slots", "Slots: the batch plus the queue", value=self.slots.capacity)
        forwards, steps, rows = self.engine.batch_stats
        yield CounterMetricFamily("mbd_engine_forwards", "Forward passes the engine ran", value=forwards)
        yield CounterMetricFamily("mbd_engine_stream_steps", "Stream steps those forwards carried (over forwards: "
                                  "the mean batch)", value=steps)
        yield CounterMetricFamily("mbd_engine_window_rows", "Window rows those forwards computed", value=rows)
        pc = self.engine.prefix_cache_stats()
        if pc.capacity_bytes:
            yield GaugeMetricFamily("mbd_prefix_cache_bytes", "K/V bytes the prefix cache holds", value=pc.bytes)
            yield GaugeMetricFamily("mbd_prefix_cache_capacity_bytes", "The prefix cache's cap",
                                    value=pc.capacity_bytes)
            yield CounterMetricFamily("mbd_prefix_cache_lookups", "Requests that looked a prefix up",
                                      value=pc.lookups)
            yield CounterMetricFamily("mbd_prefix_cache_hits", "Requests that found one", value=pc.hits)
            yield CounterMetricFamily("mbd_prefix_cache_hit_tokens", "Prompt tokens found", value=pc.hit_tokens)


class Metrics:
    """One app's metrics, in a registry of its own (several apps in one process do not mix)."""

    def __init__(self, engine: "Engine", slots: "Slots", batch: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mbd_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("mbd_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.completion_tokens = Counter("mbd_completion_tokens", "Completion tokens of finished generations",
                                         registry=r)
        self.forwards = Counter("mbd_forward_passes", "Decode forward passes of finished generations", registry=r)
        self.generations = Counter("mbd_generations", "Finished generations, by finish reason", ["finish_reason"],
                                   registry=r)
        self.tokens_per_forward = Histogram(
            "mbd_tokens_per_forward", "A finished generation's completion tokens per decode forward (usage's "
            "tokens_per_forward)", buckets=(0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16, 32), registry=r)
        self.ttft = Histogram("mbd_time_to_first_token_seconds", "From a request's arrival to its first "
                              "generated token, per generation", buckets=_LATENCY, registry=r)
        self.itl = Histogram("mbd_inter_token_latency_seconds", "Between a generation's tokens: the wait for a chunk "
                             "shared by the tokens it brings", buckets=_LATENCY, registry=r)
        r.register(_Live(engine, slots, batch))

    def answered(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def request(self, t0: float) -> "RequestMeter":
        return RequestMeter(self, t0)

    def page(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestMeter:
    """The timings of one request's generations: `chunk(i, ch)` for each chunk of choice i as it comes
    (time.monotonic() clock; `t0` the request's arrival)."""

    def __init__(self, metrics: Metrics, t0: float):
        self.m, self.t0 = metrics, t0
        self.last: dict[int, float] = {}

    def chunk(self, i: int, ch: "StreamChunk") -> None:
        now, n = time.monotonic(), len(ch.token_ids)
        if n:
            prev = self.last.get(i)
            if prev is None:
                self.m.ttft.observe(now - self.t0)
                n -= 1
                prev = now
            for _ in range(n):
                self.m.itl.observe((now - prev) / len(ch.token_ids))
            self.last[i] = now
        if ch.finish_reason:
            self.m.generations.labels(ch.finish_reason).inc()
        if ch.finish_reason and ch.usage is not None:
            u = ch.usage
            self.m.prompt_tokens.inc(u.prompt_tokens)
            self.m.completion_tokens.inc(u.completion_tokens)
            self.m.forwards.inc(u.forward_passes)
            if u.forward_passes:
                self.m.tokens_per_forward.observe(u.tokens_per_forward)


def fingerprint(path: str) -> str:
    """`system_fingerprint`: "fp_" and 16 hex digits of a BLAKE2b over this build's version and every byte of the
    model's files (the files of its directory, or its one file), so a changed build or changed weights change it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"mbd-rs {version}\0".encode())
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path) else [path])
    for f in files:
        if not os.path.isfile(f):
            continue
        h.update(os.path.basename(f).encode("utf-8", "surrogateescape") + b"\0")
        with open(f, "rb") as fh:
            while piece := fh.read(1 << 22):
                h.update(piece)
    return "fp_" + h.hexdigest()
