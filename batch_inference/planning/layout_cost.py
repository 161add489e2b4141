"""What the shard step's layout pass will cost a run, measured on the plan's sample.

The layout pass (``pipeline.placement.layout_by_prefix``) runs on the driver with the pool
already open, so every GPU waits through it: at 100M records it is hours (bench/reports/
layout_cost.md), most of it the model's tokenizer. A plan that leaves it out is short by
those hours. ``measure_layout`` runs the real pass, with the run's own signer
(``layout.signature``: by default text for plain prompts, the model's tokenizer for chat; the
spec's block size) and the spec's shard size, over the plan's sample written
to a temporary folder, on one process, and splits its time as the simulation prices it
(``Overheads.layout_record_s`` / ``layout_serial_record_s``):

- the part the run spreads over ``layout.workers`` processes: signing (rendering,
  tokenising, hashing: ``LayoutSummary.sign_s``);
- the part left in the driver's process: the rest of the pass (reading, spilling, merging,
  rewriting). The sample spills sorted runs of an eighth of itself and merges them, as a
  large input's final merge does; reading and spilling are spread over the workers at
  scale, so this part is counted high, and intermediate merge levels are not in it.

Whether the pass's second, tokenising pass runs is decided over the whole input (the text
gate, ``layout.min_gain``), which a sample of records spread through the input cannot
show (its families are thinned out): ``applies`` says what to price. The planner knows it
from the contiguous windows it reads for the prefix structure, and times a pass that
applies on those records, shuffled (a run pays the pass when its input is out of prefix
order) with the gate open; one that does not, on its sample as it is.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import orjson

from batch_inference.pipeline.placement import layout_by_prefix, layout_workers, record_prompt
from batch_inference.pipeline.resume import layout_signer
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.prompting import RequestBuilder
from batch_inference.prompting.prefix import CALIBRATION_PROMPTS
from batch_inference.storage import JsonlDir


SAMPLE_RUNS = 8
SAMPLE_RECORDS = 500  # records a plan times the pass on (~0.1-0.7 s with a model's tokenizer)
SAMPLE_SEED = 20_261_204
SAMPLE_RUN_BYTES_MIN = 16 << 10


@dataclass(frozen=True)
class LayoutCost:
    """Seconds a record of the layout pass, as measured on ``records`` sample records on one process."""

    records: int
    runs: int  # sorted runs the sample spilled (and merged, as the driver does at scale)
    spread_record_s: float  # signing: divided over the pass's worker processes
    serial_record_s: float  # reading, spilling, merging, rewriting: left in the driver (an upper bound)
    applied: bool  # the tokenising pass ran (priced as applying), else the text gate alone
    signature: str  # the tokens signed: the model's tokenizer, or text

    def overheads(self, spec: PipelineSpec, records: int) -> dict[str, Any]:
        """``Overheads`` fields for a run of ``records``: the figures and the processes the pass signs in."""
        shards = max(1, math.ceil(records / spec.shard_records))
        return {"layout_record_s": self.spread_record_s, "layout_serial_record_s": self.serial_record_s,
                "layout_workers": layout_workers(spec.layout.workers, records, shards)}


def measure_layout(spec: PipelineSpec, sample: list[dict[str, Any]], *, applies: bool) -> LayoutCost | None:
    """The layout pass over the first ``SAMPLE_RECORDS`` of ``sample`` (records as the run's
    tasks see them), timed; None when the spec lays nothing out (``layout.prefix`` off) or
    the sample is empty (blocking: a CPU pass)."""
    if not spec.layout.prefix or not sample:
        return None
    sample = sample[:SAMPLE_RECORDS]
    builder = RequestBuilder(spec.request_infer)
    prompts = [p for rec in sample[:CALIBRATION_PROMPTS] if (p := record_prompt(builder, rec)) is not None]
    signer = layout_signer(spec, sample=prompts)  # the tokenizer's load is the run's once, not a record's
    p = spec.layout
    folder = tempfile.mkdtemp(prefix="bi-plan-layout-")
    try:
        url = os.path.join(folder, "sharded")
        if applies:  # out of order, so that the pass finds an order worth rewriting, as a run that pays it does
            sample = random.Random(SAMPLE_SEED).sample(sample, len(sample))
        lines = [orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE) for rec in sample]
        with JsonlDir(url).writer_sync(max_records_per_shard=spec.shard_records, compression="zstd") as w:
            w.write_lines(lines)
        # sorted runs of an eighth of the sample: it spills and merges as a large input does
        run_bytes = max(SAMPLE_RUN_BYTES_MIN, sum(map(len, lines)) // SAMPLE_RUNS)
        t0 = time.perf_counter()
        summary = layout_by_prefix(url, signer=signer, infer=spec.request_infer, records_per_shard=spec.shard_records,
                                   spill_url=os.path.join(folder, "spill"), min_gain=0.0 if applies else p.min_gain,
                                   run_bytes=min(p.run_bytes, run_bytes), workers=1)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    n = max(1, summary.records)
    return LayoutCost(records=summary.records, runs=summary.runs, spread_record_s=summary.sign_s / n,
                      serial_record_s=max(0.0, wall - summary.sign_s) / n, applied=summary.applied,
                      signature=summary.signature)
