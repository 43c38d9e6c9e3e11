"""``LLM.get_metrics()`` in vLLM's shapes (``vllm.v1.metrics.reader``): ``Counter``, ``Gauge``,
``Vector`` and ``Histogram`` objects with vLLM's metric names where vLLM has the figure, and
``batchgen:`` names for the KV-sharing figures vLLM does not report.

Counters and gauges come from the engine's ``stats()``; the per-request histograms (prompt and
generated tokens, end-to-end latency) are recorded by ``LLM`` as requests finish.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("+Inf" last) -> cumulative count, as Prometheus reports


@dataclass
class HistogramRecorder:
    """Observations of one histogram, kept as per-bucket counts."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def metric(self, name: str, labels: dict[str, str]) -> Histogram:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative, buckets = 0, {}
        for bound, n in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += n
            buckets[bound] = cumulative
        return Histogram(name, labels, self.count, self.sum, buckets)


@dataclass
class RequestMetrics:
    """What ``LLM`` records per finished request."""

    prompt_tokens: HistogramRecorder = field(default_factory=lambda: HistogramRecorder(TOKEN_BUCKETS))
    generation_tokens: HistogramRecorder = field(default_factory=lambda: HistogramRecorder(TOKEN_BUCKETS))
    e2e_latency: HistogramRecorder = field(default_factory=lambda: HistogramRecorder(LATENCY_BUCKETS))
    finished_reasons: dict[str, int] = field(default_factory=dict)
    prompt_token_total: int = 0
    generation_token_total: int = 0

    def observe(self, prompt_tokens: int, generated_tokens: int, seconds: float, reasons: list[str]) -> None:
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated_tokens)
        self.e2e_latency.observe(seconds)
        self.prompt_token_total += prompt_tokens
        self.generation_token_total += generated_tokens
        for reason in reasons:
            self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1


def collect(stats: dict[str, float | int | str], live: dict[str, int], requests: RequestMetrics,
            model_name: str) -> list[Metric]:
    """The metrics of one ``LLM``: ``stats`` its engine's ``stats()``, ``live`` the requests running
    and waiting now and the blocks in use, ``requests`` what finished requests recorded."""
    labels = {"model_name": model_name, "engine": "0"}

    def stat(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    out: list[Metric] = [
        Gauge("vllm:num_requests_running", labels, live["running"]),
        Gauge("vllm:num_requests_waiting", labels, live["waiting"]),
        Gauge("vllm:kv_cache_usage_perc", labels, live["used_blocks"] / max(1, stat("num_blocks"))),
        Counter("vllm:num_preemptions", labels, stat("num_preemptions")),
        Counter("vllm:prompt_tokens", labels, requests.prompt_token_total),
        Counter("vllm:generation_tokens", labels, requests.generation_token_total),
        Counter("vllm:prefix_cache_hits", labels, stat("prefix_cache_hit_tokens")),
        Counter("vllm:prefix_cache_queries", labels, requests.prompt_token_total),
    ]
    for reason, n in sorted(requests.finished_reasons.items()):
        out.append(Counter("vllm:request_success", {**labels, "finished_reason": reason}, n))
    out += [
        requests.prompt_tokens.metric("vllm:request_prompt_tokens", labels),
        requests.generation_tokens.metric("vllm:request_generation_tokens", labels),
        requests.e2e_latency.metric("vllm:e2e_request_latency_seconds", labels),
        Gauge("batchgen:num_blocks", labels, stat("num_blocks")),
        Gauge("batchgen:peak_blocks_used", labels, stat("peak_blocks_used")),
        Counter("batchgen:cow_copies", labels, stat("cow_copies")),
        Gauge("batchgen:kv_saved_by_sharing", labels, float(stats.get("kv_saved_by_sharing", 0.0) or 0.0)),
        Counter("batchgen:num_swap_outs", labels, stat("num_swap_outs")),
        Counter("batchgen:steps", labels, stat("steps")),
    ]
    return out
