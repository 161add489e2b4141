"""Materialisation metadata: the figures the Dagster UI plots and the funnel it shows.

Pure functions from pipeline summaries (``as_dict()`` of the frozen dataclasses the steps
return) and the ledger view to Dagster metadata. Numeric keys are the same on every
materialisation of an asset, so the UI's plots over partitions read as the run's story.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

MAX_LISTED_SHARDS = 20


def _rate(num: float, den: float) -> float:
    return round(num / den, 4) if den else 0.0


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


def phase_metadata(summary: dict[str, Any]) -> dict[str, Any]:
    """Figures of one fan-out (a round's infer or judge phase, or the tail)."""
    counts = summary.get("counts", {})
    records = int(summary.get("records_in", 0))
    wall = float(summary.get("wall_s", 0.0))
    approved = int(counts.get("approved", 0))
    rejected = int(counts.get("rejected", 0))
    quarantined = sum(int(q.get("records", 0)) for q in summary.get("quarantined", []))
    meta: dict[str, Any] = {
        "records": dg.MetadataValue.int(records),
        "approved": dg.MetadataValue.int(approved),
        "rejected": dg.MetadataValue.int(rejected),
        "approval_rate": dg.MetadataValue.float(_rate(approved, approved + rejected)),
        "quarantined_records": dg.MetadataValue.int(quarantined),
        "quarantined_shards": dg.MetadataValue.int(len(summary.get("quarantined", []))),
        "tokens_in": dg.MetadataValue.int(int(summary.get("tokens_in", 0))),
        "tokens_out": dg.MetadataValue.int(int(summary.get("tokens_out", 0))),
        "utilization": dg.MetadataValue.float(_rate(float(summary.get("engine_busy_s", 0.0)), wall)),
        "avg_fill": dg.MetadataValue.float(round(float(summary.get("avg_fill", 0.0)), 4)),
        "records_per_s": dg.MetadataValue.float(round(records / wall, 2) if wall else 0.0),
        "wall_s": dg.MetadataValue.float(round(wall, 3)),
        "drain_s": dg.MetadataValue.float(round(float(summary.get("drain_s", 0.0)), 3)),
        "shards": dg.MetadataValue.int(int(summary.get("shards", 0))),
        "shards_run": dg.MetadataValue.int(int(summary.get("shards_run", 0))),
        "cached_tasks": dg.MetadataValue.int(int(summary.get("cached_tasks", 0))),
        "input": location(str(summary.get("input_url", ""))),
        "output": location(str(summary.get("output_url", ""))),
    }
    for key, value in counts.items():
        if key not in ("approved", "rejected"):
            meta[f"count.{key}"] = dg.MetadataValue.int(int(value))
    return meta


def round_metadata(infer: dict[str, Any], judge: dict[str, Any]) -> dict[str, Any]:
    """A whole round's figures (infer + judge phases): what ``approved``/``rejected`` show.

    Tokens, engine time and wall time add up over both phases; the batch fill is the
    inference phase's (a rule judge runs no model).
    """
    merged = dict(judge)
    merged["records_in"] = int(infer.get("records_in", 0)) + sum(int(q.get("records", 0)) for q in infer.get("quarantined", []))
    for key in ("tokens_in", "tokens_out", "engine_busy_s", "wall_s", "drain_s"):
        merged[key] = infer.get(key, 0) + judge.get(key, 0)
    merged["avg_fill"] = max(float(infer.get("avg_fill", 0.0)), float(judge.get("avg_fill", 0.0)))
    merged["quarantined"] = list(infer.get("quarantined", [])) + list(judge.get("quarantined", []))
    merged["input_url"] = infer.get("input_url", judge.get("input_url", ""))
    return phase_metadata(merged)


def funnel_markdown(view: Any) -> str:
    """The run's funnel from its ledger: one row per round, then the tail and the end."""
    lines = [
        "| step | in | approved | rejected | quarantined | approval | tokens in/out | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    if view.shard:
        lines.append(f"| shard | {view.shard.get('records', 0)} | | | | | | {float(view.shard.get('wall_s', 0)):.2f} |")
    for entry in view.rounds:
        judge, infer = entry.get("judge") or {}, entry.get("infer") or {}
        counts = judge.get("counts", {})
        a, rj = int(counts.get("approved", 0)), int(counts.get("rejected", 0))
        q = sum(int(x.get("records", 0)) for x in infer.get("quarantined", []) + judge.get("quarantined", []))
        wall = float(infer.get("wall_s", 0)) + float(judge.get("wall_s", 0))
        tokens = f"{int(infer.get('tokens_in', 0)) + int(judge.get('tokens_in', 0))}/{int(infer.get('tokens_out', 0)) + int(judge.get('tokens_out', 0))}"
        decision = (entry.get("decision") or {}).get("kind", "")
        label = f"round {entry['round']:02d}" + (f" -> {decision}" if decision else "")
        lines.append(f"| {label} | {infer.get('records_in', 0)} | {a} | {rj} | {q} | {_rate(a, a + rj):.1%} | {tokens} | {wall:.2f} |")
    if view.tail:
        t = view.tail
        counts = t.get("counts", {})
        a = int(counts.get("approved", 0))
        rest = int(t.get("records_in", 0)) - a
        q = sum(int(x.get("records", 0)) for x in t.get("quarantined", []))
        lines.append(
            f"| tail (in place) | {t.get('records_in', 0)} | {a} | {rest} | {q} | {_rate(a, int(t.get('records_in', 0))):.1%} | "
            f"{t.get('tokens_in', 0)}/{t.get('tokens_out', 0)} | {float(t.get('wall_s', 0)):.2f} |"
        )
    if view.run:
        r = view.run
        lines.append(
            f"| **run: {r.get('status', '')}** | {r.get('records', 0)} | {r.get('approved', 0)} | "
            f"{int(r.get('exhausted', 0)) + int(r.get('max_attempts', 0))} (unfinished) | {r.get('failed', 0)} | "
            f"{_rate(int(r.get('approved', 0)), int(r.get('records', 0))):.1%} | {r.get('tokens_in', 0)}/{r.get('tokens_out', 0)} | "
            f"{float(r.get('wall_s', 0)):.2f} |"
        )
    return "\n".join(lines)
