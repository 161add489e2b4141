"""A worker's /metrics exposition, read back with Prometheus' own parser (pool/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from batch_inference.pool.metrics import prometheus_text, worker_registry


def samples(text: str) -> dict[str, tuple[str, float, dict[str, str]]]:
    return {s.name: (f.type, s.value, s.labels) for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_stat_is_a_parsed_sample_of_its_type_and_value() -> None:
    stats = {"worker": "127.0.0.1:9", "engine_loads": 1, "tokens_in": 120, "tokens_out": 30, "records_done": 10,
             "tokens_per_s": 12.5, "in_flight": 3, "kv_cache_usage": 0.25, "capacity": None,
             "batcher": {"recent": {"utilization": 0.5, "avg_batch_size": 4.0}}}
    got = samples(prometheus_text(stats))
    assert got["batch_inference_engine_loads_total"] == ("counter", 1.0, {"worker": "127.0.0.1:9"})
    assert got["batch_inference_prompt_tokens_total"][:2] == ("counter", 120.0)
    assert got["batch_inference_completion_tokens_total"][:2] == ("counter", 30.0)
    assert got["batch_inference_tokens_per_second"][:2] == ("gauge", 12.5)
    assert got["batch_inference_requests_in_flight"][:2] == ("gauge", 3.0)
    assert got["batch_inference_engine_kv_cache_usage"][:2] == ("gauge", 0.25)
    assert got["batch_inference_batcher_recent_avg_batch_size"][:2] == ("gauge", 4.0)
    assert "batch_inference_requests_capacity" not in got  # not reported: no sample, rather than a made-up 0


def test_each_registry_reads_its_own_worker_at_each_scrape() -> None:
    from prometheus_client import generate_latest

    figures = {"worker": "a", "tasks_running": 0}
    a, b = worker_registry(lambda: figures), worker_registry(lambda: {"worker": "b", "tasks_running": 5})
    figures["tasks_running"] = 2  # read at scrape time, not when registered
    assert samples(generate_latest(a).decode())["batch_inference_tasks_running"][1:] == (2.0, {"worker": "a"})
    assert samples(generate_latest(b).decode())["batch_inference_tasks_running"][1:] == (5.0, {"worker": "b"})
