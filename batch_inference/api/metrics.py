"""The API server's ``/metrics``: Prometheus' text format, by ``prometheus_client``.

One ``CollectorRegistry`` per app (several servers in one process, as tests run them, never
share a default registry). ``ApiCollector`` reads what the server holds at scrape time: the
batch states and usage records of ``UsageBook``, and each open pool's ``stats()`` (gathered
asynchronously by ``scrape`` before the registry renders, so ``collect`` never blocks the
event loop on I/O). Names and labels are in docs/api.md ("Metrics").
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batch_inference.api.usage import OUTCOMES, TERMINAL

if TYPE_CHECKING:
    from batch_inference.api.batches import BatchManager

STATES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def pool_workers(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """Each worker's ``/stats`` from a pool's ``stats()``: ``PoolClient``'s lists them, an in-process pool is its one worker."""
    if "workers" in stats:
        return [s for s in (stats.get("workers") or {}).values() if s]
    return [stats]


class ApiCollector(Collector):
    """Batches by state, requests queued / running / done, tokens and engine-seconds per project, each pool's load."""

    def __init__(self, manager: BatchManager) -> None:
        self.manager = manager
        self.pools: dict[str, dict[str, Any]] = {}  # model -> its pool's stats() at the last scrape

    async def refresh(self) -> None:
        """Every open pool's stats, read now (the HTTP pool asks its workers)."""
        shares = dict(self.manager.open_shares)
        stats = await asyncio.gather(*(s.inner.stats() for s in shares.values()), return_exceptions=True)
        self.pools = {m: s for m, s in zip(shares, stats) if isinstance(s, dict)}

    def collect(self) -> Iterator[Metric]:
        book = self.manager.usage
        batches = GaugeMetricFamily("batch_inference_api_batches", "Batches by state", labels=["state"])
        by_state = Counter(s["status"] for s in book.states.values())
        for state in (*STATES, *sorted(set(by_state) - set(STATES))):
            batches.add_metric([state], by_state.get(state, 0))
        yield batches

        requests = GaugeMetricFamily("batch_inference_api_batch_requests",
                                     "Requests of the batches not ended: queued, running (in shard tasks in flight), done (settled)",
                                     labels=["model", "state"])
        for model, figures in sorted(self._requests().items()):
            for state in ("queued", "running", "done"):
                requests.add_metric([model, state], figures[state])
        yield requests

        ended = CounterMetricFamily("batch_inference_api_requests", "Requests of ended batches by outcome",
                                    labels=["project", "model", "outcome"])
        tokens = CounterMetricFamily("batch_inference_api_tokens", "Tokens of ended batches' output lines (their usage)",
                                     labels=["project", "model", "kind"])
        engine_tokens = CounterMetricFamily("batch_inference_api_engine_tokens",
                                            "Tokens the engine processed for the batches' tasks as they return (retries, judge attempts included)",
                                            labels=["project", "model", "kind"])
        engine_s = CounterMetricFamily("batch_inference_api_engine_seconds", "Engine-seconds of the batches' tasks",
                                       labels=["project", "model"])
        sums: dict[tuple[str, str], Counter[str]] = {}
        for rec in book.records.values():
            c = sums.setdefault((rec["project"], str(rec["model"] or "")), Counter())
            c["input"] += rec["input_tokens"]
            c["output"] += rec["output_tokens"]
            c["engine_input"] += rec["engine_input_tokens"]
            c["engine_output"] += rec["engine_output_tokens"]
            c["engine_s"] += rec["engine_seconds"]
            for outcome in OUTCOMES:
                c[outcome] += rec["requests"][outcome]
        for (project, model), c in sorted(sums.items()):
            for outcome in OUTCOMES:
                ended.add_metric([project, model, outcome], c[outcome])
            for kind in ("input", "output"):
                tokens.add_metric([project, model, kind], c[kind])
                engine_tokens.add_metric([project, model, kind], c[f"engine_{kind}"])
            engine_s.add_metric([project, model], c["engine_s"])
        yield from (ended, tokens, engine_tokens, engine_s)
        yield from self._pool_metrics()

    def _requests(self) -> dict[str, dict[str, int]]:
        """Per model, the requests of its running batches: settled, in shard tasks in flight, and the rest."""
        out: dict[str, dict[str, int]] = {}
        for state in self.manager.usage.states.values():
            if state["status"] in TERMINAL or not state.get("model"):
                continue
            counts = state.get("request_counts") or {}
            total, done = int(counts.get("total") or 0), int(counts.get("completed") or 0) + int(counts.get("failed") or 0)
            share = self.manager.open_shares.get(state.get("run") or "")
            model_cfg = self.manager.config.models.get(state.get("run") or "")
            in_flight = share.running.get(state["id"], 0) if share is not None else 0
            running = min(max(total - done, 0), in_flight * (model_cfg.shard_records if model_cfg else 0))
            f = out.setdefault(state["model"], {"queued": 0, "running": 0, "done": 0})
            f["done"] += done
            f["running"] += running
            f["queued"] += max(total - done - running, 0)
        return out

    def _pool_metrics(self) -> Iterator[Metric]:
        tps = GaugeMetricFamily("batch_inference_api_tokens_per_second", "Prompt + completion tokens per second of the model's pool", labels=["model"])
        out_tps = GaugeMetricFamily("batch_inference_api_output_tokens_per_second", "Completion tokens per second of the model's pool", labels=["model"])
        measured = GaugeMetricFamily("batch_inference_api_requests_per_second",
                                     "Requests per second the pool finished lately (what deadline estimates use)", labels=["model"])
        tasks = GaugeMetricFamily("batch_inference_api_pool_tasks_running", "Shard tasks the pool's workers run now", labels=["model"])
        in_flight = GaugeMetricFamily("batch_inference_api_pool_requests_in_flight",
                                      "Requests in the pool's streaming engines now (where the engine streams)", labels=["model"])
        kv = GaugeMetricFamily("batch_inference_api_pool_kv_cache_usage", "Fraction of a worker's KV cache in use (where the engine reports it)",
                               labels=["model", "worker"])
        for model, stats in sorted(self.pools.items()):
            workers = pool_workers(stats)
            tps.add_metric([model], sum(float(w.get("tokens_per_s") or 0.0) for w in workers))
            out_tps.add_metric([model], sum(float(w.get("output_tokens_per_s") or 0.0) for w in workers))
            tasks.add_metric([model], sum(int(w.get("tasks_running") or 0) for w in workers))
            flying = [w["in_flight"] for w in workers if w.get("in_flight") is not None]
            if flying:
                in_flight.add_metric([model], sum(flying))
            for w in workers:
                if w.get("kv_cache_usage") is not None:
                    kv.add_metric([model, str(w.get("worker") or "")], float(w["kv_cache_usage"]))
            share = self.manager.open_shares.get(model)
            rate = share.throughput.rate() if share is not None else None
            if rate is not None:
                measured.add_metric([model], rate)
        yield from (tps, out_tps, measured, tasks, in_flight, kv)


class ApiMetrics:
    """The app's own registry and its ``/metrics`` body."""

    def __init__(self, manager: BatchManager) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = ApiCollector(manager)
        self.registry.register(self.collector)

    async def scrape(self) -> bytes:
        """The exposition, with the pools' stats read first."""
        await self.collector.refresh()
        return generate_latest(self.registry)


def metrics_route(manager: BatchManager, allowed: Callable[[web.Request], bool]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /metrics`` over a registry of this app's own; ``allowed``: whether the caller may read it."""
    metrics = ApiMetrics(manager)

    async def scrape(request: web.Request) -> web.Response:
        if not allowed(request):
            return web.Response(status=401, text="/metrics needs a key of the admin project (admin_project)\n")
        return web.Response(body=await metrics.scrape(), headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"})

    return scrape
