"""The server's Prometheus metrics (``GET /metrics``, text exposition format).

One ``CollectorRegistry`` per server (never the process-global one), so two servers in one process do
not share counters. What a scrape shows:

* ``spear_queue_depth``: requests admitted that wait to start (the engine's queue, bounded by ``max_queue``);
  ``spear_requests_running``: admitted requests that started and have not ended;
  ``spear_requests_in_flight``: HTTP generation requests being served now (queued or running);
* ``spear_kv_blocks_used`` / ``spear_kv_blocks_total`` / ``spear_kv_usage_ratio``: the paged KV cache;
* ``spear_time_to_first_token_seconds`` and ``spear_inter_token_latency_seconds``: histograms; TTFT from
  the request's arrival at the server to its first generated token, ITL between successive tokens of one
  request (as the server hands them to the HTTP response);
* ``spear_itl_slo_seconds`` (the ITL SLO, when one is set), ``spear_itl_within_slo_total`` /
  ``spear_itl_observed_total`` and ``spear_slo_attainment`` (their ratio: the share of inter-token gaps
  within the SLO; NaN before the first gap or without an SLO);
* ``spear_requests_total{endpoint, outcome}`` (finished, cancelled = client gone, failed, rejected = refused
  by the engine's admission),
  ``spear_requests_rejected_total{reason}`` (queue_full, too_long, invalid, unknown_model,
  shutting_down), ``spear_prompt_tokens_total``, ``spear_generation_tokens_total``.

The gauges of the engine are read from ``Engine.stats()`` at scrape time (a custom collector), so
they are never stale.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# NOTE: on 2 CPU cores SmolLM2-135M's eager decode step is 0.6-1 s, on an H200 a few ms: the buckets
# span both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, float("inf"))
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, float("inf"))


class _EngineCollector:
    def __init__(self, stats: Callable[[], Dict], in_flight: Callable[[], int], slo_s: Optional[float],
                 attainment: Callable[[], float]) -> None:
        self.stats, self.in_flight, self.slo_s, self.attainment = stats, in_flight, slo_s, attainment

    def collect(self):
        s = self.stats()
        total = s.get("kv_total_blocks") or 0
        free = s.get("kv_free_blocks", total)
        queued = s.get("queued", 0)
        yield GaugeMetricFamily("spear_queue_depth", "Admitted requests waiting to start", value=queued)
        yield GaugeMetricFamily("spear_requests_running", "Admitted requests that started and have not ended",
                                value=max(0, s.get("live", 0) - queued))
        yield GaugeMetricFamily("spear_requests_in_flight", "HTTP generation requests being served",
                                value=self.in_flight())
        yield GaugeMetricFamily("spear_kv_blocks_used", "KV cache blocks in use", value=total - free)
        yield GaugeMetricFamily("spear_kv_blocks_total", "KV cache blocks", value=total)
        yield GaugeMetricFamily("spear_kv_usage_ratio", "Share of the KV cache in use",
                                value=(total - free) / total if total else 0.0)
        if self.slo_s is not None:
            yield GaugeMetricFamily("spear_itl_slo_seconds", "The inter-token latency SLO", value=self.slo_s)
        yield GaugeMetricFamily("spear_slo_attainment", "Share of inter-token gaps within the ITL SLO",
                                value=self.attainment())


class Metrics:
    """The counters and histograms the server updates, and the scrape (``render``)."""

    def __init__(self, stats: Callable[[], Dict], slo_itl_ms: Optional[float] = None) -> None:
        self.registry = CollectorRegistry()
        self.slo_s = slo_itl_ms / 1e3 if slo_itl_ms is not None else None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._within = self._observed = 0
        r = self.registry
        self.ttft = Histogram("spear_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("spear_inter_token_latency_seconds", "Gap between successive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.within = Counter("spear_itl_within_slo", "Inter-token gaps within the SLO", registry=r)
        self.observed = Counter("spear_itl_observed", "Inter-token gaps observed", registry=r)
        self.requests = Counter("spear_requests", "Generation requests that ended", ["endpoint", "outcome"], registry=r)
        self.rejected = Counter("spear_requests_rejected", "Requests refused", ["reason"], registry=r)
        self.prompt_tokens = Counter("spear_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("spear_generation_tokens", "Generated tokens", registry=r)
        r.register(_EngineCollector(stats, lambda: self._in_flight, self.slo_s, self.attainment))

    # -- updates (any thread)

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self._in_flight -= 1
        self.requests.labels(endpoint, outcome).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.observed.inc()
        ok = self.slo_s is not None and seconds <= self.slo_s
        if ok:
            self.within.inc()
        with self._lock:
            self._observed += 1
            self._within += ok

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def attainment(self) -> float:
        with self._lock:
            if self.slo_s is None or not self._observed:
                return float("nan")
            return self._within / self._observed

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "Metrics"]
