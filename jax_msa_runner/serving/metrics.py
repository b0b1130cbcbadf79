"""The server's Prometheus metrics, in a registry of their own (one per engine).

Counters: ``jax_msa_requests_total{outcome}`` (outcome: stop, length, abort, rejected,
overloaded, error: an internal error), ``jax_msa_prompt_tokens_total``, ``jax_msa_generation_tokens_total``,
``jax_msa_preemptions_total``, ``jax_msa_compilations_after_warmup_total`` (XLA compilations
in the process since the engine was built on its warmed-up runner: 0 while serving),
``jax_msa_prefix_cache_queries_total`` / ``jax_msa_prefix_cache_hits_total`` (tokens looked
up in the prefix cache at admission / tokens found there). Gauges: ``jax_msa_queue_depth``
(requests waiting to run), ``jax_msa_running_requests``, ``jax_msa_kv_pages_in_use`` (held by
running requests), ``jax_msa_kv_pages_total``, ``jax_msa_prefix_cache_pages`` (keyed pages,
held or evictable).
Histograms (seconds): ``jax_msa_step_latency_seconds`` (schedule + step + update),
``jax_msa_step_host_gap_seconds`` (device idle between back-to-back steps: from one step's
output reaching the host to the next step's launch), ``jax_msa_time_to_first_token_seconds``.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("stop", "length", "abort", "rejected", "overloaded", "error")
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """All metrics of one engine; ``render()`` is the /metrics body (text format)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jax_msa_requests", "Requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(outcome=o)
        self.prompt_tokens = Counter("jax_msa_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("jax_msa_generation_tokens", "Tokens generated",
                                         registry=r)
        self.preemptions = Counter("jax_msa_preemptions", "Requests preempted (recompute)",
                                   registry=r)
        self.compilations = Counter("jax_msa_compilations_after_warmup",
                                    "XLA compilations since the engine started (0 in serving)",
                                    registry=r)
        self.prefix_cache_queries = Counter("jax_msa_prefix_cache_queries",
                                            "Tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("jax_msa_prefix_cache_hits",
                                         "Tokens found in the prefix cache", registry=r)
        self.prefix_cache_pages = Gauge("jax_msa_prefix_cache_pages",
                                        "KV pages keyed in the prefix cache", registry=r)
        self.queue_depth = Gauge("jax_msa_queue_depth", "Requests waiting to run", registry=r)
        self.running = Gauge("jax_msa_running_requests", "Requests running", registry=r)
        self.kv_pages_in_use = Gauge("jax_msa_kv_pages_in_use", "KV pages held by requests",
                                     registry=r)
        self.kv_pages_total = Gauge("jax_msa_kv_pages_total", "KV pages requests can hold",
                                    registry=r)
        self.step_latency = Histogram("jax_msa_step_latency_seconds",
                                      "Engine step: schedule, device step, update",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.host_gap = Histogram("jax_msa_step_host_gap_seconds",
                                  "Device idle between back-to-back steps", buckets=_LATENCY_BUCKETS,
                                  registry=r)
        self.ttft = Histogram("jax_msa_time_to_first_token_seconds",
                              "Submission to first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
