"""What the round sensor does for rounds waiting on people (called once per tick).

A round whose judge opened a review queue records ``decision: review`` on ``rejected``;
the sensor keeps it in its cursor and, every tick, reads the round's review status
from storage (the verdict log, not the queue): once the queue is empty, or its timeout
policy decides the rest, it requests ``review_job`` for the round; until then it says
"waiting for review (N left)", reports progress as an observation of the round's
``rejected`` asset whenever it moved, and reports the ``review_age`` check failing
(WARN) once the oldest waiting record passes ``review.warn_after``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.partitions import parse_round_key
from batch_inference.defs.review.checks import review_age_evaluation
from batch_inference.defs.review.metadata import progress_metadata
from batch_inference.defs.specs import SpecNotFound, load_spec
from batch_inference.defs.storage.resources import StorageResource


@dataclass
class ReviewTick:
    """One tick's outcome: rounds ready to close, events to report, what the sensor says."""

    ready: list[tuple[str, str, str, int]] = field(default_factory=list)  # (partition, run, reason, times reopened)
    events: list[Any] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    waiting: dict[str, dict[str, Any]] = field(default_factory=dict)


def review_tick(instance: dg.DagsterInstance, waiting: dict[str, dict[str, Any]], storage: StorageResource,
                k: PipelineKeys = DEFAULT) -> ReviewTick:
    """Look at every waiting round once (``waiting``: partition -> what was last reported)."""
    from batch_inference.pipeline import PipelineRun
    from batch_inference.review.lifecycle import ReviewGate

    out = ReviewTick()
    for partition, seen in sorted(waiting.items()):
        key = parse_round_key(partition)
        try:
            spec = load_spec(instance, key.run, storage, k.source)
            status = PipelineRun(spec, gate=ReviewGate()).review_status(key.round)
        except (SpecNotFound, OSError, ValueError) as exc:  # keep waiting: a later tick may read it
            out.said.append(f"{partition}: cannot read its review status: {exc}")
            out.waiting[partition] = seen
            continue
        if status.resolved or status.resolvable:
            out.ready.append((partition, key.run, status.text, status.reopened))
            if not status.resolved:
                # Kept until the close is recorded: a close that finds an undo in what it read
                # reopens the round (its review_job fails), and the round waits again; the next
                # close is another run (its run key counts the reopenings).
                out.waiting[partition] = seen
            continue
        out.said.append(f"{partition}: {status.text}")
        data = status.as_dict()
        warned = status.oldest_age_s > spec.review.warn_after
        if seen.get("done") != status.decided:
            out.events.append(dg.AssetObservation(
                asset_key=k.rejected, partition=partition,
                metadata=progress_metadata(data, url=spec.review.url, run=spec.run)))
        if warned and not seen.get("warned"):
            # Once per round: Dagster keeps one run-less evaluation per check and partition.
            out.events.append(review_age_evaluation(data, spec.review.warn_after, partition, k.rejected))
        out.waiting[partition] = {"done": status.decided, "warned": warned or bool(seen.get("warned"))}
    return out
