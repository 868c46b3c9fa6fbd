"""Prometheus metrics of one server (GET /metrics), in a registry of its own.

Counters add up over the server's life (rates and ratios come from them: e.g. acceptance =
``rate(specdec_draft_tokens_accepted_total) / rate(specdec_draft_tokens_proposed_total)``);
gauges hold the last generation's figures and the current queue depth.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec_edge.api.streaming import GenerationResult
from specdec_edge.serve.protocol import completion_tokens

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specdec_requests", "HTTP requests answered, by path and status code", ["path", "status"], registry=r
        )
        self.generations = Counter(
            "specdec_generations",
            "Generations run, by finish reason (eos, stop, length, cancelled, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of the generations run", registry=r)
        self.reused_tokens = Counter(
            "specdec_reused_prompt_tokens", "Prompt tokens whose KV cache was kept from earlier calls", registry=r
        )
        self.prefilled_tokens = Counter(
            "specdec_prefilled_prompt_tokens", "Prompt tokens prefilled (computed, not reused)", registry=r
        )
        self.completion_tokens = Counter("specdec_completion_tokens", "Tokens generated", registry=r)
        self.target_passes = Counter("specdec_target_passes", "Target verification passes", registry=r)
        self.proposed = Counter("specdec_draft_tokens_proposed", "Draft tokens verified", registry=r)
        self.accepted = Counter("specdec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.seconds = Histogram("specdec_generation_seconds", "Wall time of each generation", registry=r)
        self.tokens_per_second = Gauge(
            "specdec_tokens_per_second", "New tokens per second of the last generation, prefill included", registry=r
        )
        self.tokens_per_pass = Gauge(
            "specdec_tokens_per_pass", "Tokens per target pass of the last generation", registry=r
        )
        self.acceptance = Gauge(
            "specdec_acceptance_rate", "Accepted / proposed draft tokens of the last generation", registry=r
        )
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting or being generated", registry=r)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Read the queue depth from ``depth()`` at every scrape."""
        self.queue_depth.set_function(depth)

    def observe(self, result: GenerationResult | None, seconds: float) -> None:
        """Record one generation that ran (None: it failed)."""
        self.seconds.observe(seconds)
        if result is None:
            self.generations.labels("error").inc()
            return
        s = result.stats
        self.generations.labels(result.finish_reason or "cancelled").inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.reused_tokens.inc(s.reused_tokens)
        self.prefilled_tokens.inc(s.prefilled_tokens)
        self.completion_tokens.inc(completion_tokens(result))
        self.target_passes.inc(s.steps)
        self.proposed.inc(s.proposed)
        self.accepted.inc(s.accepted)
        self.tokens_per_second.set(s.tokens_per_s)
        self.tokens_per_pass.set(s.tokens_per_pass)
        if s.proposed:
            self.acceptance.set(s.acceptance_rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
