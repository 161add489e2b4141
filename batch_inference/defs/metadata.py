"""Materialisation metadata: the figures the Dagster UI plots and the funnel it shows.

Pure functions from the pipeline's typed summaries (what the steps return, and the
ledger's ``LedgerView``) to Dagster metadata; every derived figure comes from the
summaries' own properties, so the UI and the CLI cannot disagree. Numeric keys are the same on every
materialisation of an asset, so the UI's plots over partitions read as the run's story.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from batch_inference.pipeline.summaries import LedgerView, PhaseSummary, RoundView, RunSummary, cache_hit_rate, prefill_vs_ideal, rate

MAX_LISTED_SHARDS = 20


def location(url: str) -> dg.MetadataValue:
    """A clickable value: a URL for object stores, a path for local files."""
    return dg.MetadataValue.url(url) if "://" in url and not url.startswith("file://") else dg.MetadataValue.path(url)


def shard_list(urls: list[str]) -> dg.MetadataValue:
    shown = urls[:MAX_LISTED_SHARDS]
    more = f"\n- ... and {len(urls) - len(shown)} more" if len(urls) > len(shown) else ""
    return dg.MetadataValue.md("\n".join(f"- `{u}`" for u in shown) + more if shown else "_no shards_")


def with_row_count(meta: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
    """Add Dagster's standard ``dagster/row_count`` (the catalog's row column): ``records`` unless given."""
    meta["dagster/row_count"] = dg.MetadataValue.int(int(meta["records"].value) if rows is None else rows)
    return meta


def phase_metadata(summary: PhaseSummary | RoundView) -> dict[str, Any]:
    """Figures of one fan-out (a round's infer or judge phase, or the tail), or of a whole
    round (``RoundView``: both phases, and people's verdicts once its review is closed;
    records = the round's pending records)."""
    if isinstance(summary, RoundView):
        records, quarantined = summary.records_in, summary.quarantined
        fill = summary.avg_fill
        extra = {k: v for p in summary.phases for k, v in p.counts.items() if k not in ("ok", "error", "approved", "rejected")}
        input_url = summary.infer.input_url if summary.infer else ""
        output_url = summary.judge.output_url if summary.judge else ""
        shards = summary.judge.shards if summary.judge else 0
        shards_run = summary.judge.shards_run if summary.judge else 0
        cached = sum(p.cached_tasks for p in summary.phases)
    else:
        records, quarantined, fill = summary.records_in, summary.quarantined, summary.avg_fill
        extra = {k: v for k, v in summary.counts.items() if k not in ("approved", "rejected")}
        input_url, output_url = summary.input_url, summary.output_url
        shards, shards_run, cached = summary.shards, summary.shards_run, summary.cached_tasks
    approved, rejected, wall = summary.approved, summary.rejected, summary.wall_s
    meta: dict[str, Any] = {
        "records": dg.MetadataValue.int(records),
        "approved": dg.MetadataValue.int(approved),
        "rejected": dg.MetadataValue.int(rejected),
        "approval_rate": dg.MetadataValue.float(summary.approval if isinstance(summary, RoundView) else rate(approved, records)),
        "quarantined_records": dg.MetadataValue.int(sum(q.records for q in quarantined)),
        "quarantined_shards": dg.MetadataValue.int(len(quarantined)),
        "tokens_in": dg.MetadataValue.int(summary.tokens_in),
        "tokens_out": dg.MetadataValue.int(summary.tokens_out),
        "utilization": dg.MetadataValue.float(rate(summary.engine_busy_s, wall)),
        "avg_fill": dg.MetadataValue.float(round(fill, 4)),
        "records_per_s": dg.MetadataValue.float(round(records / wall, 2) if wall else 0.0),
        # "is the engine full?": what it delivered (compare with bench/engine_ceiling.py), and
        # its own occupancy (engine.*); utilization and avg_fill only say it was fed
        "output_tokens_per_s": dg.MetadataValue.float(round(summary.output_tokens_per_s, 1)),
        "wall_s": dg.MetadataValue.float(round(wall, 3)),
        "drain_s": dg.MetadataValue.float(round(summary.drain_s, 3)),
        "shards": dg.MetadataValue.int(shards),
        "shards_run": dg.MetadataValue.int(shards_run),
        "cached_tasks": dg.MetadataValue.int(cached),
        "input": location(input_url),
        "output": location(output_url),
    }
    if isinstance(summary, RoundView):  # records that ended failed in the round (RoundView.failed)
        meta["failed_records"] = dg.MetadataValue.int(summary.failed)
    for key, value in extra.items():
        meta[f"count.{key}"] = dg.MetadataValue.int(int(value))
    for key, value in summary.engine.items():
        meta[f"engine.{key}"] = dg.MetadataValue.text(value) if isinstance(value, str) else dg.MetadataValue.float(float(value))
    meta.update(placement_metadata(summary))
    meta.update(cache_metadata(summary))
    return meta


def cache_metadata(summary: PhaseSummary | RoundView) -> dict[str, Any]:
    """What the engine did not compute: requests answered by an identical one (always), and
    its prefix cache (where the engine keeps one): hit rate, prompt tokens prefilled, the
    ideal (each distinct prefix computed once) and their ratio."""
    phases = summary.phases if isinstance(summary, RoundView) else [summary]
    meta: dict[str, Any] = {
        "duplicates": dg.MetadataValue.int(sum(p.duplicates for p in phases)),
        "duplicate_tokens_in": dg.MetadataValue.int(sum(p.duplicate_tokens_in for p in phases)),
        "duplicate_tokens_out": dg.MetadataValue.int(sum(p.duplicate_tokens_out for p in phases)),
    }
    # the cross-run result cache (pool.result_cache): requests earlier runs answered
    lookups, hits = sum(p.result_cache_lookups for p in phases), sum(p.result_cache_hits for p in phases)
    meta["result_cache_lookups"] = dg.MetadataValue.int(lookups)
    meta["result_cache_hits"] = dg.MetadataValue.int(hits)
    meta["engine_requests"] = dg.MetadataValue.int(sum(p.engine_requests for p in phases))
    if lookups:
        meta["result_cache_hit_rate"] = dg.MetadataValue.float(rate(hits, lookups))
    if (hit_rate := cache_hit_rate(phases)) is not None:
        meta["prefix_cache_hit_rate"] = dg.MetadataValue.float(hit_rate)
        meta["prefill_tokens"] = dg.MetadataValue.int(sum(p.prefill_tokens for p in phases))
    if (vs_ideal := prefill_vs_ideal(phases)) is not None:
        meta["ideal_prefill_tokens"] = dg.MetadataValue.int(sum(p.ideal_prefill_tokens or 0 for p in phases))
        meta["prefill_vs_ideal"] = dg.MetadataValue.float(vs_ideal)
    return meta


def result_cache_run_metadata(summary: RunSummary) -> dict[str, Any]:
    """The run's cross-run result cache (``pool.result_cache``): requests looked up, answered
    by earlier runs, their rate, the requests the engines ran, and the store after the trim."""
    meta: dict[str, Any] = {
        "result_cache_lookups": dg.MetadataValue.int(summary.result_cache_lookups),
        "result_cache_hits": dg.MetadataValue.int(summary.result_cache_hits),
        "engine_requests": dg.MetadataValue.int(summary.engine_requests),
    }
    if (hit_rate := summary.result_cache_hit_rate) is not None:
        meta["result_cache_hit_rate"] = dg.MetadataValue.float(hit_rate)
    for key in ("entries", "bytes", "evicted"):
        if key in summary.result_cache:
            meta[f"result_cache.{key}"] = dg.MetadataValue.int(int(summary.result_cache[key]))
    return meta


def placement_metadata(summary: PhaseSummary | RoundView) -> dict[str, Any]:
    """The pool, model and adapter each phase ran on (``PhaseSummary.ran_on``): ``ran_on.<key>``
    for a phase, ``ran_on.<phase>.<key>`` for a round's two."""
    phases = [(f"{p.phase}.", p) for p in summary.phases] if isinstance(summary, RoundView) else [("", summary)]
    return {f"ran_on.{prefix}{key}": dg.MetadataValue.text(str(value) if value is not None else "-")
            for prefix, phase in phases for key, value in phase.ran_on.items()}


def funnel_markdown(view: LedgerView) -> str:
    """The run's funnel from its ledger: one row per round, then the tail and the end.

    The same figures as the CLI's ledger table: "in" is a round's pending records
    (quarantined shards included), "failed" the records that ended failed in it
    (``RoundView.failed``), and approval is approved / in.
    """
    lines = [
        "| step | in | approved | rejected | failed | approval | tokens in/out | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if view.shard:
        lines.append(f"| shard | {view.shard.records} | | | | | | {view.shard.wall_s:.2f} |")
    for rnd in view.rounds:
        label = f"round {rnd.round:02d}" + (f" -> {rnd.decision.kind}" if rnd.decision else "")
        lines.append(f"| {label} | {rnd.records_in} | {rnd.approved} | {rnd.rejected} | {rnd.failed} | "
                     f"{rnd.approval:.1%} | {rnd.tokens_in}/{rnd.tokens_out} | {rnd.wall_s:.2f} |")
    if t := view.tail:
        lines.append(
            f"| tail (in place) | {t.records_total} | {t.approved} | {t.max_attempts} (max attempts) | {t.records_failed} | "
            f"{rate(t.approved, t.records_total):.1%} | {t.tokens_in}/{t.tokens_out} | {t.wall_s:.2f} |"
        )
    if r := view.run:
        lines.append(
            f"| **run: {r.status}** | {r.records} | {r.approved} | {r.unfinished} (unfinished) | {r.failed} | "
            f"{rate(r.approved, r.records):.1%} | {r.tokens_in}/{r.tokens_out} | {r.wall_s:.2f} |"
        )
    return "\n".join(lines)
