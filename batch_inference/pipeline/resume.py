"""What a run resumes from: the shard step, and the checks every resumed step makes.

A killed driver re-runs into a resume (``pipeline.run``): each step finds its own ledger
entry and output and reuses them. That is only right under the spec the run started
with, for the keys that decide results (``spec.result_changes``); ``Resume`` holds that
check, the reuse of a step's finished output, and the shard step (the input resharded,
then laid out in prefix order), whose intermediate ``shard-input`` entry is what an
interrupted layout pass resumes from.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import orjson

from batch_inference.engines.base import Prompt
from batch_inference.pipeline import inputs, passes, placement
from batch_inference.pipeline.accounting import EXAMPLES, InputAccount, line_name
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.spec import PipelineSpec, SpecChanged, result_changes
from batch_inference.pipeline.summaries import LayoutSummary, ShardSummary
from batch_inference.prompting import RequestBuilder
from batch_inference.prompting.openai_batch import OpenAIBatchReader
from batch_inference.prompting.prefix import CALIBRATION_PROMPTS, SIMULATED_CHARS_PER_TOKEN, PrefixSigner
from batch_inference.storage import JsonlDir, ReshardReport

if TYPE_CHECKING:
    from batch_inference.pipeline.stream import ShardFeed

log = logging.getLogger(__name__)

__all__ = ["Resume", "SHARD_INPUT_KEYS"]

# The spec keys the resharded input (the ``shard-input`` entry and ``sharded/`` before the
# layout pass) is made from: an entry made under other values is never reused.
SHARD_INPUT_KEYS = ("input", "input_format", "openai_batch", "shard_records", "id_field")
# The layout keys that decide which records a laid-out shard holds (beside SHARD_INPUT_KEYS and
# the model's tokenizer, which the spec check covers): round 0 started on its shards only under the same.
LAYOUT_ORDER_KEYS = ("prefix", "signature", "block_size", "prefix_tokens", "min_gain")


class Resume:
    """The run's resume logic over its ledger: the spec check, reusable outputs, the shard step."""

    def __init__(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger) -> None:
        self.spec = spec
        self.layout = layout
        self.ledger = ledger
        self.storage_options = spec.storage_options or None
        self._signer: PrefixSigner | None = None
        self._signer_lock = threading.Lock()  # the shard step's thread and the dispatch may ask at once

    def check_spec(self) -> None:
        """Refuse to go on under a spec whose result-deciding keys changed since the run
        started: its output would hold two specs' results, and nothing would say so."""
        recorded = self.ledger.read(RunLayout.SPEC)
        if recorded is None:
            return
        now = self.spec.folder_digests()  # none: no local folder to compare by its files (no read then)
        then = self.ledger.read(RunLayout.SPEC_FOLDERS) if now else None  # absent in a ledger from before fingerprints
        folders = (then, now) if then is not None else None
        changed = result_changes(recorded, self.spec.public_dict(), folders=folders)
        if changed:
            raise SpecChanged(
                f"run {self.spec.run!r} started under another spec: {', '.join(changed)} changed since "
                f"{self.layout.ledger_file(RunLayout.SPEC)} was recorded. Resuming would mix the two specs' "
                f"results. Give the spec a new `run` name, or delete {self.layout.root} to start over, or restore "
                "those keys to resume.")

    def done_with_output(self, name: str, output_url: str) -> dict[str, Any] | None:
        """The step's ledger entry if it finished and its output directory is committed."""
        data = self.ledger.read(name)
        return data if data is not None and JsonlDir(output_url, storage_options=self.storage_options).manifest() is not None else None

    # -- the shard step -----------------------------------------------------------------

    async def shard(self, feed: ShardFeed | None = None) -> ShardSummary:
        """Reshard the input once (CPU): ids assigned where missing, duplicate ids reported.

        The spec is checked before anything is written: a run that already resharded its
        input (``shard-input``) or finished this step resumes only under the spec it
        started with, and ``ledger/spec.json`` stays the one it started with. A step that
        left nothing to resume from starts over under the spec it is given now, unless
        round 0 had started beside it (``feed``: each shard of the layout pass's rewrite as
        it commits, ``pipeline.stream``): then under the same spec and shard keys only, with
        the same run instance, so that a shard's index holds the same records and its
        finished tasks count (resharding and the layout pass are deterministic).
        """
        if (done := await asyncio.to_thread(self.done_with_output, RunLayout.SHARD, self.layout.sharded)) is not None:
            await asyncio.to_thread(self.check_spec)
            return ShardSummary.from_dict({**done, "resumed": True})
        instance = await asyncio.to_thread(self._streamed_instance)
        await asyncio.to_thread(self._start)
        t0 = time.perf_counter()
        report, fmt = await self._reshard_input()
        laid_out = None
        if self.spec.layout.prefix:
            on_shard = None
            if feed is not None:
                feed.instance, feed.total_records = instance, report.records
                streamed = {"instance": instance, "shard": self._stream_keys()}

                def on_shard(stats: dict[str, Any], common: int) -> None:  # on the writing thread
                    if not feed.fed_any:  # recorded before any task of round 0 carries the instance
                        self.ledger.write(RunLayout.SHARD_STREAM, streamed)
                        feed.fed_any = True
                    feed.committed(str(stats["name"]), int(stats["records"]), common)
            laid_out = await asyncio.to_thread(self._lay_out, on_shard)
        dups = report.duplicate_ids
        account = InputAccount(records=report.records, malformed=report.malformed,
                               malformed_at=[line_name(e) for e in report.malformed_lines], duplicate_ids=len(dups),
                               duplicate_examples=list(dups)[:EXAMPLES], quarantine=self.layout.input_quarantine)
        for note in account.notes():
            log.warning("run %s: %s", self.spec.run, note)
        summary = ShardSummary(
            input_url=self.spec.input, output_url=self.layout.sharded, records=report.records,
            shards=await asyncio.to_thread(self._committed_shards),  # the layout pass cuts its own shards
            ids_assigned=report.ids_assigned, duplicate_ids=len(dups), duplicate_examples=list(dups)[:10],
            wall_s=time.perf_counter() - t0, malformed=report.malformed,
            malformed_examples=account.malformed_at, quarantine_url=self.layout.input_quarantine if report.malformed else "",
            input_format=fmt, instance=instance,
            layout=laid_out,
        )
        await asyncio.to_thread(self.ledger.write, RunLayout.SHARD, summary.as_dict())
        return summary

    def _stream_keys(self) -> str:
        """A fingerprint of what decides a laid-out shard's records: the input's keys and the layout's order."""
        layout = self.spec.public_dict().get("layout") or {}
        return self.depends(SHARD_INPUT_KEYS) + ":" + hashlib.sha256(
            orjson.dumps({k: layout.get(k) for k in LAYOUT_ORDER_KEYS}, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def _streamed_instance(self) -> str:
        """The run instance of a shard step starting (again): an earlier attempt's when round 0
        had started beside it (its tasks and their outputs carry it), after checking that the
        spec and the shard keys are the ones they were made under; else a new one (blocking)."""
        streamed = self.ledger.read(RunLayout.SHARD_STREAM)
        if streamed is None:
            return uuid.uuid4().hex[:12]
        self.check_spec()
        if streamed.get("shard") != self._stream_keys():
            raise SpecChanged(
                f"run {self.spec.run!r}: round 0 started on shards laid out under other "
                f"{', '.join(SHARD_INPUT_KEYS)} or layout.{{{', '.join(LAYOUT_ORDER_KEYS)}}} "
                f"({self.layout.ledger_file(RunLayout.SHARD_STREAM)}); its finished tasks hold other records under the "
                "same shard numbers. Give the spec a new `run` name, or delete "
                f"{self.layout.root} to start over, or restore those keys to resume.")
        return str(streamed["instance"])

    def _start(self) -> None:
        """Check the spec against the recorded one when there is something to resume from,
        else record it: the run starts (over) under this spec (blocking)."""
        if self.ledger.read(RunLayout.SPEC) is not None and self.done_with_output(RunLayout.SHARD_INPUT, self.layout.sharded):
            self.check_spec()
            return
        self.ledger.write(RunLayout.SPEC_FOLDERS, self.spec.folder_digests())
        self.ledger.write(RunLayout.SPEC, self.spec.public_dict())

    def _committed_shards(self) -> int:
        """How many shards ``sharded/`` holds as committed (blocking)."""
        man = JsonlDir(self.layout.sharded, storage_options=self.storage_options).manifest()
        return len(man.shards) if man is not None else 0

    def depends(self, keys: tuple[str, ...]) -> str:
        """A fingerprint of the spec's ``keys``: what an intermediate ledger entry was made
        from, so that it is reused only under the same values."""
        data = self.spec.public_dict()
        return hashlib.sha256(orjson.dumps({k: data.get(k) for k in keys}, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    async def _reshard_input(self) -> tuple[ReshardReport, str]:
        """The input resharded into ``sharded/``, or what an interrupted shard step already
        resharded (its ``shard-input`` entry, while ``sharded/`` is still committed and the
        entry was made from this spec's ``SHARD_INPUT_KEYS``)."""
        spec_keys = self.depends(SHARD_INPUT_KEYS)
        done = await asyncio.to_thread(self.done_with_output, RunLayout.SHARD_INPUT, self.layout.sharded)
        if done is not None and done.get("spec") == spec_keys:
            return ReshardReport(**done["report"]), str(done["input_format"])
        if done is not None:
            log.info("run %s: %s was resharded under other %s: resharding it again", self.spec.run, self.layout.sharded,
                     "/".join(SHARD_INPUT_KEYS))
        fmt, detected = await asyncio.to_thread(inputs.resolve_format, self.spec)
        if detected:
            log.info("run %s: %s is %s input (detected: input_format auto); converting at sharding", self.spec.run, self.spec.input,
                     {"openai_batch": "OpenAI Batch", "parquet": "Parquet"}.get(fmt, fmt))
        reader = inputs.record_reader(self.spec, fmt)  # its record format's converter (pipeline.record_formats)
        transform = inputs.record_transform(self.spec, fmt, reader)
        source = await asyncio.to_thread(inputs.open_input, self.spec.input, self.storage_options)
        report = await asyncio.to_thread(
            passes.shard_input, source, self.layout.sharded,
            records_per_shard=self.spec.shard_records, storage_options=self.storage_options,
            quarantine_url=self.layout.input_quarantine, transform=transform,
        )
        inputs.check_records(self.spec, report.records, report.malformed)  # refused, not recorded: nothing to run
        if isinstance(reader, OpenAIBatchReader):  # refused before any GPU time: the shard step is not recorded
            inputs.check_openai_input(reader, report, self.spec.input, self.storage_options)
        await asyncio.to_thread(self.ledger.write, RunLayout.INPUT_SCHEMA, inputs.schema_entry(source))  # the Parquet export's types
        await asyncio.to_thread(self.ledger.write, RunLayout.SHARD_INPUT,
                                {"report": asdict(report), "input_format": fmt, "spec": spec_keys})
        return report, fmt

    def signer(self) -> PrefixSigner:
        """The layout's signer: the shard step's, recompaction's and the dispatch's, one a run
        (blocking: its tokenizer's load). Its text's characters a token are the ones the shard
        step's layout recorded (4 in a ledger from before the figure was recorded), else
        measured on the first records of ``sharded/`` (the input's order: a shard step that
        starts again reshards it, and measures the same records)."""
        with self._signer_lock:
            if self._signer is None:
                laid = (self.ledger.read(RunLayout.SHARD) or {}).get("layout") or {}
                chars = float(laid.get("chars_per_token") or SIMULATED_CHARS_PER_TOKEN) if laid else None
                sample = [] if chars is not None or not self.spec.layout.prefix else self._sample_prompts()
                self._signer = layout_signer(self.spec, sample=sample, chars=chars)
            return self._signer

    def _sample_prompts(self) -> list[Prompt]:
        """The prompts of the first ``CALIBRATION_PROMPTS`` records of ``sharded/`` (none before it is written)."""
        d = JsonlDir(self.layout.sharded, storage_options=self.storage_options)
        if d.manifest() is None:
            return []
        builder = RequestBuilder(self.spec.request_infer)
        lines = d.iter_parsed_lines_sync()
        try:
            return [p for rec, _ in itertools.islice(lines, CALIBRATION_PROMPTS)
                    if (p := placement.record_prompt(builder, rec)) is not None]
        finally:
            lines.close()

    def _lay_out(self, on_shard: Callable[[dict[str, Any], int], None] | None = None) -> LayoutSummary:
        """``sharded/`` in prefix order (``pipeline.placement``; blocking); ``on_shard``: each
        rewritten shard as it commits."""
        p = self.spec.layout
        return placement.layout_by_prefix(
            self.layout.sharded, signer=self.signer(), infer=self.spec.request_infer, records_per_shard=self.spec.shard_records,
            spill_url=self.layout.layout_spill, storage_options=self.storage_options, min_gain=p.min_gain,
            run_bytes=p.run_bytes, workers=p.workers, on_shard=on_shard,
        )


def layout_signer(spec: PipelineSpec, *, sample: Sequence[Prompt] = (), chars: float | None = None) -> PrefixSigner:
    """The signer a run's layout pass signs records with (the plan prices the pass with it too);
    its text's characters a token are ``chars``, else measured on ``sample`` (``prompting.prefix``)."""
    p = spec.layout
    return PrefixSigner.for_engine(spec.engine, kind=p.signature, block_size=p.block_size, prefix_tokens=p.prefix_tokens,
                                   sample=sample, chars=chars)
