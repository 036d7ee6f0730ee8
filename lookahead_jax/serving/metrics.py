"""The server's Prometheus metrics (`/metrics`), in a registry of their own per server.

    lookahead_requests_total{method,outcome}     finished requests (stop, length, cancelled,
                                                 error) and refused ones (rejected: queue full)
    lookahead_generated_tokens_total{method}     tokens sent to clients
    lookahead_steps_total{method}                forward passes of finished requests (prefill
                                                 included, as `Stats.steps` counts)
    lookahead_step_compression{method}           S: generated tokens per forward pass, over
                                                 the finished requests of that method
    lookahead_tokens_per_step{method}            histogram: tokens one step gave one request
    lookahead_tokens_per_second                  generated tokens/s over the last 10 s
    lookahead_queue_length                       requests waiting for a slot
    lookahead_slots_busy / lookahead_slots       occupied slots / all slots
    lookahead_time_to_first_token_seconds        histogram, from arrival to the first token
    lookahead_request_latency_seconds            histogram, from arrival to the last token
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, slots: int, window_s: float = 10.0):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lookahead_requests", "Requests by method and outcome",
                                ["method", "outcome"], registry=r)
        self.tokens = Counter("lookahead_generated_tokens", "Generated tokens sent to clients",
                              ["method"], registry=r)
        self.steps = Counter("lookahead_steps", "Forward passes of finished requests "
                             "(prefill included)", ["method"], registry=r)
        self.compression = Gauge("lookahead_step_compression", "Generated tokens per forward "
                                 "pass (S) over finished requests", ["method"], registry=r)
        self.per_step = Histogram("lookahead_tokens_per_step", "Tokens one step gave one "
                                  "request", ["method"], buckets=tuple(range(1, 17)), registry=r)
        self.rate = Gauge("lookahead_tokens_per_second",
                          f"Generated tokens per second over the last {window_s:g} s",
                          registry=r)
        self.queue = Gauge("lookahead_queue_length", "Requests waiting for a slot", registry=r)
        self.busy = Gauge("lookahead_slots_busy", "Occupied slots", registry=r)
        self.total_slots = Gauge("lookahead_slots", "Slots", registry=r)
        self.total_slots.set(slots)
        self.ttft = Histogram("lookahead_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("lookahead_request_latency_seconds", "Arrival to last token",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self._window_s = window_s
        self._recent: collections.deque = collections.deque()  # (time, tokens)
        self._lock = threading.Lock()
        self._totals: dict[str, list[int]] = {}  # method -> [tokens, steps] of finished requests

    def generated(self, method: str, n: int) -> None:
        if n <= 0:
            return
        self.tokens.labels(method).inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
        self.update_rate(now)

    def update_rate(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window_s:
                self._recent.popleft()
            self.rate.set(sum(n for _, n in self._recent) / self._window_s)

    def finished(self, method: str, outcome: str, tokens: int, steps: int) -> None:
        self.requests.labels(method, outcome).inc()
        if steps > 0:
            self.steps.labels(method).inc(steps)
            with self._lock:
                t = self._totals.setdefault(method, [0, 0])
                t[0] += tokens
                t[1] += steps
                self.compression.labels(method).set(t[0] / t[1])

    def text(self) -> bytes:
        self.update_rate()
        return generate_latest(self.registry)
