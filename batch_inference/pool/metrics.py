"""A worker's ``/metrics``: its ``/stats`` as Prometheus metrics, through ``prometheus_client``.

``WorkerCollector`` reads ``WorkerRuntime.stats()`` at each scrape (no state of its own);
each app registers it in a ``CollectorRegistry`` of its own (``worker_registry``), never the
process-wide default, so several workers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus' text format

# stats key -> (metric name, type, help)
_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("engine_loads", "batch_inference_engine_loads_total", "counter", "Engine builds in this process (1 when healthy)"),
    ("model_load_time_s", "batch_inference_model_load_seconds", "gauge", "Seconds the engine took to load"),
    ("engine_busy_s", "batch_inference_engine_busy_seconds_total", "counter", "Seconds the engine had work (in generate / a request in flight)"),
    ("uptime_s", "batch_inference_uptime_seconds", "gauge", "Seconds since the worker started"),
    ("idle_s", "batch_inference_idle_seconds", "gauge", "Seconds since the last task ended (0 while busy)"),
    ("concurrency", "batch_inference_task_slots", "gauge", "Task slots"),
    ("tasks_running", "batch_inference_tasks_running", "gauge", "Tasks running now"),
    ("tasks_completed", "batch_inference_tasks_completed_total", "counter", "Tasks finished"),
    ("tasks_failed", "batch_inference_tasks_failed_total", "counter", "Tasks that raised"),
    ("tasks_cached", "batch_inference_tasks_cached_total", "counter", "Idempotent replays of finished tasks"),
    ("tasks_refused", "batch_inference_tasks_refused_total", "counter", "Tasks refused (busy or draining)"),
    ("tasks_abandoned", "batch_inference_tasks_abandoned_total", "counter", "Tasks abandoned by shutdown"),
    ("records_done", "batch_inference_records_total", "counter", "Records read by finished tasks"),
    ("tokens_in", "batch_inference_prompt_tokens_total", "counter", "Prompt tokens of finished tasks"),
    ("tokens_out", "batch_inference_completion_tokens_total", "counter", "Completion tokens of finished tasks"),
    ("utilization", "batch_inference_batcher_utilization", "gauge", "Fraction of time the model call runs"),
    ("avg_fill", "batch_inference_batcher_avg_fill", "gauge", "Average batch cost / token budget"),
    ("records_per_s", "batch_inference_batcher_records_per_second", "gauge", "Records through the batcher per second"),
    ("tokens_per_s", "batch_inference_tokens_per_second", "gauge", "Prompt + completion tokens per second"),
    # "is the GPU full?": output tokens/s against the engine's own ceiling, and the engine's occupancy
    ("output_tokens_per_s", "batch_inference_output_tokens_per_second", "gauge", "Completion tokens per second"),
    ("in_flight", "batch_inference_requests_in_flight", "gauge", "Requests in a streaming engine now"),
    ("capacity", "batch_inference_requests_capacity", "gauge", "Requests the worker keeps in a streaming engine"),
    ("engine_running", "batch_inference_engine_running_requests", "gauge", "Sequences the engine is decoding (its own count)"),
    ("engine_waiting", "batch_inference_engine_waiting_requests", "gauge", "Requests waiting in the engine's scheduler"),
    ("kv_cache_usage", "batch_inference_engine_kv_cache_usage", "gauge", "Fraction of the engine's KV cache in use"),
)

_RECENT: tuple[tuple[str, str], ...] = (
    ("utilization", "batch_inference_batcher_recent_utilization"),
    ("avg_fill", "batch_inference_batcher_recent_avg_fill"),
    ("avg_batch_size", "batch_inference_batcher_recent_avg_batch_size"),
    ("records_per_s", "batch_inference_batcher_recent_records_per_second"),
)


class WorkerCollector(Collector):
    """The metrics of one worker's stats, read from ``stats`` at each collect (labelled ``worker``)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        worker = [str(stats.get("worker", ""))]
        for key, name, kind, help_text in _METRICS:
            value = stats.get(key)
            if value is None:
                continue
            family = CounterMetricFamily(name, help_text, labels=["worker"]) if kind == "counter" else \
                GaugeMetricFamily(name, help_text, labels=["worker"])
            family.add_metric(worker, float(value))
            yield family
        recent = (stats.get("batcher") or {}).get("recent") or {}
        for key, name in _RECENT:
            if key in recent:
                family = GaugeMetricFamily(name, f"{key} of the batcher's recent batches", labels=["worker"])
                family.add_metric(worker, float(recent[key]))
                yield family


def worker_registry(stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry of its own holding a ``WorkerCollector`` over ``stats``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(stats))
    return registry


def prometheus_text(stats: dict[str, Any]) -> str:
    """``stats`` (a ``WorkerRuntime.stats()``) in the Prometheus text format."""
    return generate_latest(worker_registry(lambda: stats)).decode()
