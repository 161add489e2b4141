"""``batch-inference shard`` and ``batch-inference inspect``: the storage layer's commands."""

from __future__ import annotations

import time

import click
from rich.console import Console
from rich.table import Table

from batch_inference.storage import JsonlDir, JsonlFile, ReshardReport, UnreadableInputError, input_format, open_source, reshard, urls
from batch_inference.storage.parquet import ParquetSource
from batch_inference.storage.sources import READABLE
from batch_inference.storage.directory import DEFAULT_MAX_BYTES


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--records-per-shard", "-n", type=click.IntRange(min=1), required=True, help="Rotate after N records.")
@click.option(
    "--max-bytes-per-shard", type=click.IntRange(min=1), default=DEFAULT_MAX_BYTES, show_default=True,
    help="Also rotate before a shard exceeds this many uncompressed bytes.",
)
@click.option("--compression", type=click.Choice(["zstd", "none"]), default="zstd", show_default=True)
@click.option("--no-ids", is_flag=True, help="Do not assign ids to records that lack one.")
def shard(src: str, dst: str, records_per_shard: int, max_bytes_per_shard: int, compression: str, no_ids: bool) -> None:
    """Stream SRC (a .jsonl / .jsonl.zst file or a shard directory) into shards under DST, in constant memory.

    DST is replaced whole. Records without an ``id`` get one: their 0-based position in
    SRC as 12 digits. Duplicate ids are reported (exit code 0; they are the caller's call).
    """
    console = Console(stderr=True)
    t0 = time.perf_counter()
    try:
        report = reshard(
            src, dst, records_per_shard=records_per_shard, max_bytes_per_shard=max_bytes_per_shard,
            compression=None if compression == "none" else "zstd", assign_ids=not no_ids,
        )
    except (UnreadableInputError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    wall = time.perf_counter() - t0
    console.print(
        f"[green]wrote[/] {report.records:,} records in {report.shards:,} shards to {JsonlDir(dst).url} "
        f"({report.bytes / 1e6:,.1f} MB uncompressed, {wall:.1f}s, {report.records / max(wall, 1e-9):,.0f} records/s); "
        f"{report.ids_assigned:,} ids assigned"
    )
    if report.duplicate_ids:
        shown = ", ".join(f"{k!r} x{v}" for k, v in list(report.duplicate_ids.items())[:10])
        console.print(f"[yellow]warning:[/] {len(report.duplicate_ids):,} duplicate ids: {shown}")


@click.command()
@click.argument("url")
def inspect(url: str) -> None:
    """Show shard count, record count, bytes and compression of a shard file or directory.

    Exits 1 on a folder holding files of no format the readers know (named by extension),
    and on a file none of whose lines is a record.
    """
    console = Console()
    probe = JsonlFile(url)
    try:
        fmt = input_format(url)
        parquet = open_source(url) if fmt == "parquet" else None
    except (UnreadableInputError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    if isinstance(parquet, ParquetSource):  # rows from the footers: nothing decoded
        rows = [(urls.basename(f), n, None, parquet.fs.size(urls.fs_for(f)[1])) for f, n in zip(parquet.files, parquet.rows_by_file)]
        source, compression = "Parquet footers", ["parquet"]
    elif probe.fs.isdir(probe.path):
        d = JsonlDir(url)
        man = d.manifest()
        shards = d.shards()
        if man is not None:
            rows = [(s["name"], s["records"], s["bytes"], s.get("stored_bytes")) for s in man.shards]
            source = "manifest"
        else:
            rows = [(s.name, sum(1 for _ in s.iter_records_sync()), None, s.fs.size(s.path)) for s in shards]
            source = "listing (no manifest: records counted by reading)"
        compression = sorted({"zstd" if s.compressed else "none" for s in shards}) or ["-"]
    else:
        bad = ReshardReport()
        records = sum(1 for _ in probe.iter_records_sync(on_error="quarantine", quarantine=bad.count_malformed))
        if bad.malformed and not records:
            raise click.ClickException(f"{probe.url}: {bad.malformed} line(s), none of them a JSON object: "
                                       f"not a format this input reads (it reads {READABLE})")
        rows = [(probe.name, records, None, probe.fs.size(probe.path))]
        source, compression = "file", ["zstd" if probe.compressed else "none"]
        if bad.malformed:
            source += f"; {bad.malformed} malformed line(s) not counted, e.g. line {bad.malformed_lines[0]['line']}"

    table = Table(title=f"{probe.url}  ({source})")
    for col in ("shard", "records", "bytes (raw)", "bytes (stored)"):
        table.add_column(col, justify="left" if col == "shard" else "right")
    shown = rows if len(rows) <= 20 else rows[:10] + [("...", None, None, None)] + rows[-10:]
    for name, recs, raw, stored in shown:
        table.add_row(name, _n(recs), _n(raw), _n(stored))
    console.print(table)
    total_raw = sum(r[2] or 0 for r in rows) if all(r[2] is not None for r in rows) else None
    total_stored = sum(r[3] or 0 for r in rows) if all(r[3] is not None for r in rows) else None
    console.print(
        f"shards: {len(rows):,}  records: {sum(r[1] for r in rows):,}  bytes (raw): {_n(total_raw)}  "
        f"bytes (stored): {_n(total_stored)}  compression: {', '.join(compression)}"
    )


def _n(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"
