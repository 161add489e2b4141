"""Export a finished run in the OpenAI Batch output format: one output file, one error file.

Every input request lands in exactly one of the two (checked against the sharded input
count): approved records are answers (``response.status_code`` 200, ``body`` a
chat.completion / text_completion with ``usage``); every other terminal state is an error
line with its reason: ``exhausted`` (rejected in every round), ``max_attempts`` (in-place
retry gave up), the record's own permanent error (``bad_messages``, ``bad_sampling``,
``prompt_too_long``, ...), and ``shard_quarantined`` for records of a quarantined shard.
An input line that was no record at all (malformed: left out at sharding) is an error line
too, ``malformed_line``, whose message names its ``file:line`` and whose ``custom_id`` is
null (no id could be read from it): the two files hold one line per input line
(``pipeline.accounting``). A duplicate input id is answered once per occurrence, so it
appears that many times; the summary's ``notes`` say so.
Lines are written with ``jsonl_line``: a raw U+0085 / U+2028 / U+2029 in an answer is
escaped, so a reader splitting on every line break (Python's ``str.splitlines()``) still
reads one object a line. Blocking and streaming (constant memory); call it off the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batch_inference.pipeline.accounting import InputAccount, line_name, malformed_message, quarantined_lines
from batch_inference.pipeline.run import PipelineRun, StepOrderError
from batch_inference.pipeline.summaries import ShardSummary, _Summary
from batch_inference.prompting.openai_batch import error_code, error_line, jsonl_line, output_line
from batch_inference.rows import Status, strip_results
from batch_inference.storage import CheckpointStore, JsonlDir, JsonlFile
from batch_inference.storage.urls import fs_for, join


MALFORMED_LINE = "malformed_line"  # the error code of an input line that was no record


class ExportError(RuntimeError):
    """The export does not account for every input request exactly once."""


@dataclass(frozen=True)
class ExportSummary(_Summary):
    output_url: str
    errors_url: str
    requests: int
    output: int
    errors: int
    errors_by_code: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    lines: int = 0  # the input's lines (records + malformed): what output + errors add up to
    malformed: int = 0  # of them, lines that were no record (an error line each, ``malformed_line``)
    notes: list[str] = field(default_factory=list)  # the input account's warnings (``InputAccount.notes``)


def _rows(urls: tuple[str, ...], storage_options: dict[str, Any] | None, *, is_dir: bool = True) -> Iterator[dict[str, Any]]:
    for url in urls:
        if is_dir:
            d = JsonlDir(url, storage_options=storage_options)
            if d.exists_sync():
                yield from d.iter_records_sync()
        else:
            f = JsonlFile(url, storage_options=storage_options)
            if f.exists_sync():
                yield from f.iter_records_sync()


def _failure(state: str, row: dict[str, Any], max_rounds: int) -> tuple[str, str]:
    """(code, message) of a record that got no approved answer."""
    if state == Status.EXHAUSTED:
        return Status.EXHAUSTED.value, f"not approved in {max_rounds} round(s) (max_rounds): last rejection: {row.get('rejection') or 'none'}"
    if row.get("status") == Status.MAX_ATTEMPTS:
        reason = (row.get("verdict") or {}).get("reason") or row.get("last_error") or "none"
        return Status.MAX_ATTEMPTS.value, f"not approved after {row.get('attempts')} attempt(s) (max_attempts): last rejection: {reason}"
    reason = str(row.get("reason") or row.get("error") or row.get("rejection") or "unknown error")
    return error_code(reason), reason


def _committed_in_running_tail(run: PipelineRun) -> dict[str, dict[str, Any]]:
    """id -> the final state (approved, max_attempts, error) of each record a tail task had
    checkpointed when the run was stopped, over the tail shards that never finished (no
    progress record): what a cancel delivers of a shard cut short. Blocking."""
    layout, so = run.layout, run.storage_options
    if run.ledger.read(layout.TAIL) is not None:
        return {}
    finished = run.ledger.progress(layout.TAIL, None)
    folder = JsonlDir(join(layout.tail, "checkpoints"), storage_options=so)
    if not folder.exists_sync():
        return {}
    fs, path = fs_for(folder.url, so)
    fs.invalidate_cache(path)
    finals: dict[str, dict[str, Any]] = {}
    for name in sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)):
        if not name.startswith("part-") or not name[5:].isdigit() or int(name[5:]) in finished:
            continue
        for rid, state in CheckpointStore(layout.tail_checkpoint(int(name[5:])), storage_options=so).load_sync().items():
            if state.get("final"):
                finals[rid] = state["final"]
    return finals


def export_openai_batch(run: PipelineRun, out: str | None = None, *, unfinished: tuple[str, str] | None = None,
                        judged: bool = False) -> ExportSummary:
    """Write ``<out>/output.jsonl`` and ``<out>/errors.jsonl`` (default ``RunLayout.openai_export``).

    ``unfinished`` (``(code, message)``) exports a run that was stopped before its end (a
    cancelled or expired batch): what reached a terminal state is written as usual (a tail
    shard cut short by the stop included: the records its task had checkpointed), and every
    other sharded request becomes an error line with that code, so each is still in exactly one
    file. The run's driver must be stopped first (nothing may reach a terminal state meanwhile).
    ``judged``: each output line also says which attempt was approved (``output_line``).
    """
    t0 = time.perf_counter()
    spec, layout, so = run.spec, run.layout, run.storage_options
    shard = run.ledger.read_as(layout.SHARD, ShardSummary)
    if shard is None or (unfinished is None and run.ledger.read(layout.RUN) is None):
        raise StepOrderError(f"run {spec.run!r} is not finished (ledger/run.json is missing): run it to the end first")
    seen: set[str] | None = set() if unfinished is not None else None
    out = out or layout.openai_export
    out_url, err_url = join(out, "output.jsonl"), join(out, "errors.jsonl")
    created = int(time.time())
    codes: dict[str, int] = {}
    counts = {"output": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def error(custom_id: str, code: str, message: str) -> dict[str, Any]:
        codes[code] = codes.get(code, 0) + 1
        counts["errors"] += 1
        if seen is not None:
            seen.add(custom_id)
        return error_line(custom_id, run=spec.run, code=code, message=message)

    def answered(row: dict[str, Any]) -> dict[str, Any]:
        """The output line of an approved row, counted (and seen)."""
        line = output_line(row, run=spec.run, model=spec.model_name, created=created, judged=judged)
        usage = line["response"]["body"]["usage"]
        counts["output"] += 1
        counts["prompt_tokens"] += usage["prompt_tokens"]
        counts["completion_tokens"] += usage.get("completion_tokens", 0)  # an embeddings body has none
        if seen is not None:
            seen.add(line["custom_id"])
        return line

    with JsonlFile(out_url, storage_options=so).writer_sync() as ok, JsonlFile(err_url, storage_options=so).writer_sync() as bad:
        for row in _rows((layout.results,), so):
            ok.write_lines([jsonl_line(answered(row))])
        for source in run.terminal_sources():
            if source.state in ("input", Status.APPROVED) or not source.is_dir:
                continue
            for row in _rows(source.urls, so):
                bad.write_lines([jsonl_line(error(str(row["id"]), *_failure(source.state, row, spec.max_rounds)))])
        for q in run.quarantined():
            for row in _rows((q.shard,), so, is_dir=False):
                bad.write_lines([jsonl_line(error(str(row["id"]), "shard_quarantined", f"shard_quarantined: {q.error}"))])
        for entry in quarantined_lines(layout.input_quarantine, so):  # no record was read from these lines
            bad.write_lines([jsonl_line({**error(line_name(entry), MALFORMED_LINE, malformed_message(entry)), "custom_id": None})])
        if seen is not None and unfinished is not None:
            committed = _committed_in_running_tail(run)
            for row in _rows((layout.sharded,), so):
                rid = str(row["id"])
                if rid in seen:
                    continue
                if (final := committed.pop(rid, None)) is None:
                    bad.write_lines([jsonl_line(error(rid, *unfinished))])
                    continue
                done = {**strip_results(row), **final}  # finished by a tail task the stop cut short
                if done.get("status") == Status.APPROVED:
                    ok.write_lines([jsonl_line(answered(done))])
                else:
                    bad.write_lines([jsonl_line(error(rid, *_failure("unfinished", done, spec.max_rounds)))])
    total = counts["output"] + counts["errors"]
    account = InputAccount.of_shard(shard, layout.input_quarantine)
    if total != account.lines or codes.get(MALFORMED_LINE, 0) != account.malformed:
        raise ExportError(f"run {spec.run!r}: exported {total} lines ({counts['output']} output, {counts['errors']} "
                          f"errors, {codes.get(MALFORMED_LINE, 0)} of them malformed lines) but the input has "
                          f"{account.summary()}: the run's terminal sets (or {layout.input_quarantine}) do not add up")
    return ExportSummary(output_url=out_url, errors_url=err_url, requests=total, output=counts["output"],
                         errors=counts["errors"], errors_by_code=dict(sorted(codes.items())),
                         prompt_tokens=counts["prompt_tokens"], completion_tokens=counts["completion_tokens"],
                         wall_s=time.perf_counter() - t0, lines=account.lines, malformed=account.malformed,
                         notes=account.notes())
