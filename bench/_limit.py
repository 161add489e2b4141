"""The throughput limit, measured in the same run as the pipeline (issue 32 item 1).

The limit is what no order of the same requests can beat on the same engine and cache:
the raw bench engine (the same ``LLM`` object, the same KV-cache configuration the
pipeline's engine is built with) given **each distinct request once, in prefix order, in
one ``LLM.generate`` call**, its prefix cache emptied first. Every distinct prefix is then
computed once and every distinct request once; duplicates of a request are answered by
its one run, so the limit's records/s counts every input record.

Used by ``bench/workload_aware.py`` (one in-process engine) and ``bench/prefill_ideal.py``
(a local pool of one and of two workers), which report the pipeline's records/s against it
with and without the shard step (where the layout pass runs), beside the prefill-token
figures, named as such.

Imported as ``_limit`` (a bench script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def limit_order(ids: list[list[int]]) -> list[list[int]]:
    """Each distinct request once, in prefix order (token-id order: requests sharing a
    prefix are adjacent, a shorter request before the longer ones it prefixes)."""
    return [list(x) for x in sorted({tuple(x) for x in ids})]


def measure_limit(llm: Any, encode: Callable[[list[dict[str, Any]]], list[list[int]]], records: list[dict[str, Any]],
                  output: int, stop: list[str] | None = None) -> dict[str, Any]:
    """The limit on ``llm``: its cache emptied, ``records`` tokenised (timed, as ``LLM.generate``
    of text and the pipeline's phase tokenise too), each distinct request once in prefix order,
    one ``generate`` call, exactly ``output`` tokens each at temperature 0 (with ``stop``
    strings: at most ``output``, ended by a stop string)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    length = {"max_tokens": output, "stop": list(stop)} if stop else {"max_tokens": output, "min_tokens": output}
    sampling = SamplingParams(**length, temperature=0.0)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    ids = limit_order(encode(records))
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sampling_params=sampling, use_tqdm=False)
    secs = time.perf_counter() - t0
    return {"records": len(records), "requests": len(ids), "prompt_tokens": sum(map(len, ids)),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": secs, "records_s": len(records) / secs}


def against_limit(run: dict[str, Any], limit: dict[str, Any]) -> dict[str, float]:
    """A pipeline run's records/s against the limit: over its infer phase alone (``of_limit``)
    and with the shard step, where the layout pass runs, added to its wall (``of_limit_shard``)."""
    with_shard = run["records"] / (run["seconds"] + run.get("shard_s", 0.0))
    return {"records_s": run["records"] / run["seconds"], "records_s_shard": with_shard,
            "of_limit": run["records"] / run["seconds"] / limit["records_s"], "of_limit_shard": with_shard / limit["records_s"]}


class StepCounters:
    """The engine's own scheduler figures, one entry per scheduler update (about one engine
    step): running and waiting requests, prefix-cache lookups and hits, preempted requests
    looked up again; and, where given, how many requests the pipeline had in flight at the
    engine then (issue 32 item 2: running sets against the limit's, preemptions, the timeline)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int, int]] = []  # (seconds, running, waiting, pipeline in flight or -1)
        self.queries = self.hits = self.preempted = 0
        self.t0 = time.perf_counter()

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def add(self, stats: Any, in_flight: int = -1) -> None:
        """One ``SchedulerStats`` (vLLM hands a fresh one to its stat loggers every update)."""
        if stats is None:
            return
        self.steps.append((time.perf_counter() - self.t0, int(stats.num_running_reqs), int(stats.num_waiting_reqs), in_flight))
        p = getattr(stats, "prefix_cache_stats", None)
        if p is not None:
            self.queries += int(p.queries or 0)
            self.hits += int(p.hits or 0)
            self.preempted += int(getattr(p, "preempted_requests", 0) or 0)

    def summary(self) -> dict[str, Any]:
        busy = [s for s in self.steps if s[1]]
        running = sorted(s[1] for s in busy) or [0]
        flight = [s[3] for s in busy if s[3] >= 0]
        return {"steps": len(busy), "running_mean": sum(running) / len(running), "running_p50": running[len(running) // 2],
                "running_max": running[-1], "waiting_mean": sum(s[2] for s in busy) / max(1, len(busy)),
                "preempted": self.preempted, "hit_share": self.hits / self.queries if self.queries else 0.0,
                "in_flight_mean": sum(flight) / len(flight) if flight else None,
                "first_step_s": busy[0][0] if busy else None}


def count_llm_steps(llm: Any) -> StepCounters:
    """``StepCounters`` of an ``LLM`` built with ``disable_log_stats=False``: its stat-logger
    manager's ``record`` is wrapped (``LLM`` has no public hook for the scheduler's figures)."""
    counters = StepCounters()
    manager = llm.llm_engine.logger_manager
    assert manager is not None, "LLM built without statistics (disable_log_stats=False is needed)"
    record = manager.record

    def counting(*args: Any, **kwargs: Any) -> Any:
        counters.add(kwargs.get("scheduler_stats", args[0] if args else None))
        return record(*args, **kwargs)

    manager.record = counting
    return counters


def count_engine_steps(engine: Any, gate: Any = None) -> StepCounters:
    """``StepCounters`` of the pipeline's ``VllmStreamingEngine``: its stat logger stores every
    update's ``SchedulerStats`` and then adds their prefix figures, which is wrapped here; the
    host's ``StreamGate`` (``gate``) says how many requests the pipeline had in flight."""
    counters = StepCounters()
    add = engine._add_prefix_stats

    def counting(stats: Any) -> None:
        counters.add(engine._stats, gate.in_flight if gate is not None else -1)
        add(stats)

    engine._add_prefix_stats = counting
    return counters
