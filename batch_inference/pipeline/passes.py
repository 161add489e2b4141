"""The pipeline's CPU passes: shard the input once, repack rejects, write terminal sets.

All blocking and streaming (one record at a time, constant memory); callers run them
with ``asyncio.to_thread``. None needs a GPU or the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from typing import Any

from batch_inference import rows
from batch_inference.pipeline.placement import FamilyCuts, shard_limit
from batch_inference.rows import Status, permanent_error
from batch_inference.storage import JsonlDir, JsonlFile, ReshardReport, reshard
from batch_inference.storage.reshard import Source

# A record with a permanent error (rows.PERMANENT: it would fail the same way on every
# attempt) ends ``failed`` with its reason at once instead of burning every remaining round.


class _FailedSink:
    """Writes rows with a permanent error to ``dst`` as ``status: failed`` (opened on first use)."""

    def __init__(self, dst: str | None, storage_options: dict[str, Any] | None, *, every_error: bool = False) -> None:
        self.dst, self.storage_options = dst, storage_options
        self.every_error = every_error  # a run without a judge: any inference error is final
        self.records = 0
        self._stack = ExitStack()
        self._w: Any = None

    def take(self, rec: dict[str, Any], round: int | None = None) -> bool:
        reason = (permanent_error(rec) or (rec.get("error") or rec.get("rejection") if self.every_error else None)) if self.dst else None
        if reason is None:
            return False
        if self._w is None:
            self._w = self._stack.enter_context(JsonlDir(self.dst, storage_options=self.storage_options).writer_sync(compression="zstd"))  # type: ignore[arg-type]
        self._w.write({**rec, "status": Status.FAILED, "reason": reason, "failed_round": round})
        self.records += 1
        return True

    def __enter__(self) -> _FailedSink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


MAX_RAW_CHARS = 4096  # of a malformed line kept in its quarantine entry


def shard_input(
    src: str | Source, dst: str, *, records_per_shard: int, storage_options: dict[str, Any] | None = None,
    quarantine_url: str | None = None, transform: Callable[[dict, int], dict] | None = None,
) -> ReshardReport:
    """Reshard ``src`` (a JSONL(.zst) or Parquet file or folder, or its reader) into ``dst``; ids assigned when missing.

    Duplicate input ids are reported (``report.duplicate_ids``), never merged. With
    ``quarantine_url``, malformed lines (bad JSON, bad UTF-8, not an object) are written
    there as ``{file, line, reason, raw}`` and the rest goes on (``report.malformed``).
    ``transform`` converts each input record first (``inputs.record_transform``: OpenAI Batch
    lines to native records, the input's fields named as the run's kept aside, the id column);
    a record it refuses (``RefusedRecord``) is quarantined like a malformed line.
    """
    if quarantine_url is None:
        return reshard(src, dst, records_per_shard=records_per_shard, storage_options=storage_options, transform=transform)
    with ExitStack() as stack:
        sink: list[Any] = []

        def quarantine(entry: dict[str, Any]) -> None:
            if not sink:
                sink.append(stack.enter_context(JsonlFile(quarantine_url, storage_options=storage_options).writer_sync()))
            sink[0].write({**entry, "raw": entry["raw"][:MAX_RAW_CHARS]})

        return reshard(src, dst, records_per_shard=records_per_shard, storage_options=storage_options,
                       on_error="quarantine", quarantine=quarantine, transform=transform)


def recompact(
    src: str, dst: str, *, records_per_shard: int, storage_options: dict[str, Any] | None = None,
    failed_dst: str | None = None, round: int | None = None, families: FamilyCuts | None = None,
) -> tuple[int, int, int, int]:
    """Repack the rejected shards of a round into full pending shards for the next round.

    The judge writes one rejected shard per inferred shard, so without this the shard
    count survives every round while the record count collapses. Rows with a permanent
    error go to ``failed_dst`` instead (terminal ``failed``). With ``families`` (the
    prefix-aware layout was applied) each shard ends between two prefix families, as the
    shard step's do, instead of every ``records_per_shard`` records: a family cut in two
    would run in two tasks, maybe on two workers, and its prefix be computed twice.
    Returns ``(records, shards_in, shards_out, cuts_shared)``: the last counts the cuts
    whose records either side share a leading block (0 when cut by count).
    """
    source = JsonlDir(src, storage_options=storage_options)
    shards = source.shards() if source.exists_sync() else []
    out = JsonlDir(dst, storage_options=storage_options)
    limit = shard_limit(records_per_shard) if families else records_per_shard
    cuts_shared = 0
    with _FailedSink(failed_dst, storage_options) as failed, out.writer_sync(max_records_per_shard=limit, compression="zstd") as w:

        def kept() -> Iterator[dict[str, Any]]:
            for shard in shards:
                for rec in shard.iter_records_sync():
                    if not failed.take(rec, round):
                        yield rows.strip_results(rec)  # the next round recomputes every result field

        if families is None:
            w.write_many(kept())
        else:
            cuts_shared = families.write(w, kept(), records_per_shard)
        records = w.records
    man = out.manifest()
    return records, len(shards), len(man.shards) if man else 0, cuts_shared


def write_exhausted(
    src_dirs: Iterable[str], dst: str, *, round: int, storage_options: dict[str, Any] | None = None,
    failed_dst: str | None = None, every_error: bool = False,
) -> int:
    """Write the records still rejected at the round cap as ``status: exhausted``
    (those with a permanent error to ``failed_dst`` as ``failed``; with ``every_error``,
    a run without a judge, those with any error)."""
    out = JsonlDir(dst, storage_options=storage_options)
    with _FailedSink(failed_dst, storage_options, every_error=every_error) as failed, out.writer_sync(compression="zstd") as w:
        for url in src_dirs:
            d = JsonlDir(url, storage_options=storage_options)
            if not d.exists_sync():
                continue
            for rec in d.iter_records_sync():
                if failed.take(rec, round):
                    continue
                rec["status"] = Status.EXHAUSTED
                rec["exhausted_round"] = round
                w.write(rec)
        return w.records


def split_tail_shard(
    src: str, approved: str, unfinished: str, *, storage_options: dict[str, Any] | None = None
) -> dict[str, int]:
    """Split one in-place retry output shard: approved rows into results, the rest aside."""
    counts = {Status.APPROVED: 0, Status.MAX_ATTEMPTS: 0, Status.ERROR: 0}
    with (
        JsonlFile(approved, storage_options=storage_options).writer_sync() as ok,
        JsonlFile(unfinished, storage_options=storage_options).writer_sync() as rest,
    ):
        for rec in JsonlFile(src, storage_options=storage_options).iter_records_sync():
            status = rec.get("status")
            if status == Status.APPROVED:
                ok.write(rec)
            else:
                rest.write(rec)
            counts[Status(status) if status in counts else Status.ERROR] += 1
    return {str(k): v for k, v in counts.items()}


def count_shard(url: str, storage_options: dict[str, Any] | None = None) -> int:
    """Records in one shard (0 when it does not exist)."""
    f = JsonlFile(url, storage_options=storage_options)
    if not f.exists_sync():
        return 0
    return sum(1 for _ in f.iter_records_sync())
