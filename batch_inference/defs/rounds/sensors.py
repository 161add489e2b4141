"""The round sensor: moves every pipeline run from one step to the next.

It reads, in storage order, the materialisations that end a step: ``source_dataset``
(a run was started), ``sharded``, ``rejected`` (a round was judged, with the pipeline's
decision as metadata) and ``tail_retry``. For each it requests exactly one follow-up:

    source_dataset[run]  -> shard_job   sharded[run]
    sharded[run]         -> round_job   run|r00     (strategy in_place: tail_job from round 0)
    rejected[run|rNN]    -> next_round: round_job run|rNN+1 (adding the round label first)
                            tail:       tail_job  (recompact rNN, retry in place from NN+1)
                            done | exhausted: results_job
                            review: wait on the round's review queue (below)
    reviewed[run|rNN]    -> as rejected (the decision taken once the review closed)
    tail_retry[run]      -> results_job

A round waiting for people stays in the cursor; every tick reads its review status from
storage and requests ``review_job`` (which materialises ``reviewed``) once the queue is
empty or the spec's timeout policy decides the rest; until then the tick says "waiting
for review (N left)" (``defs.review.sensor``).

A plain ``@sensor`` with the last storage id as its cursor, not an ``@asset_sensor``:
every event since the cursor is read (paginated), so several rounds landing between two
ticks are all acted on. An event is acted on only once the Dagster run that produced
it has finished: a run that failed (a blocking check, a step error) gets no follow-up,
so a wrong round never propagates. Waiting is per pipeline run: an event whose Dagster
run is still going defers only the later events of the same pipeline run, never another
pipeline's; the cursor (``SensorCursor``) keeps the storage id below which every event
was handled plus the ids above it already handled, so no event is lost or handled twice. Run keys name the step (``<run>|r01``), so a
re-evaluated tick or a re-materialised round never launches the same step twice.

Before reading events, each tick recovers crashed steps (``defs.recovery``): a run whose
worker process died is marked failed and its step requested again as
``<run key>:retry-N`` (bounded); its new materialisation is then followed up as usual.
"""

import json
from datetime import datetime, timezone
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from batch_inference.defs.jobs import PipelineJobs, build_jobs
from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.partitions import RoundKey, parse_round_key
from batch_inference.defs.recovery import recover
from batch_inference.defs.review.sensor import review_tick
from batch_inference.defs.rounds.assets import REVIEW_DECISION
from batch_inference.defs.storage.resources import StorageResource

_DEFAULT_JOBS = build_jobs(DEFAULT)


def watched(k: PipelineKeys = DEFAULT) -> tuple[dg.AssetKey, ...]:
    """The materialisations that end a step of pipeline ``k``."""
    return (k.source, k.sharded, k.rejected, k.reviewed, k.tail_retry)


WATCHED = watched(DEFAULT)
PAGE = 100
MAX_EVENTS_PER_TICK = 500
RUN_TAG = "batch_inference/run"


@dataclass(frozen=True)
class Action:
    """One follow-up step: the job, its partition, its idempotency key."""

    job_name: str
    partition_key: str
    run_key: str
    run: str
    reason: str
    new_round_label: str | None = None
    run_config: Mapping[str, Any] = field(default_factory=dict)

    def run_request(self) -> dg.RunRequest:
        return dg.RunRequest(
            run_key=self.run_key,
            job_name=self.job_name,
            partition_key=self.partition_key,
            run_config=dict(self.run_config),
            tags={RUN_TAG: self.run, "batch_inference/reason": self.reason[:200]},
        )


def _text(metadata: Mapping[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    return None if value is None else str(getattr(value, "value", value))


def _round_action(key: RoundKey, reason: str, jobs: PipelineJobs = _DEFAULT_JOBS) -> Action:
    return Action(jobs.round.name, str(key), f"{key}", key.run, reason, new_round_label=key.round_label)


def _tail_action(run: str, from_round: int, reason: str, jobs: PipelineJobs = _DEFAULT_JOBS) -> Action:
    return Action(jobs.tail.name, run, f"{run}:tail", run, reason,
                  run_config={"ops": {jobs.tail_op: {"config": {"from_round": from_round}}}})


def _results_action(run: str, reason: str, jobs: PipelineJobs = _DEFAULT_JOBS) -> Action:
    return Action(jobs.results.name, run, f"{run}:results", run, reason)


def follow_up(asset_key: dg.AssetKey, partition_key: str, metadata: Mapping[str, Any], k: PipelineKeys = DEFAULT,
              jobs: PipelineJobs = _DEFAULT_JOBS) -> Action | None:
    """The one step that follows a materialisation of pipeline ``k`` (pure: the sensor's whole policy)."""
    if asset_key == k.source:
        return Action(jobs.shard.name, partition_key, f"{partition_key}:shard", partition_key, "run started")
    if asset_key == k.sharded:
        if _text(metadata, "strategy") == "in_place":
            return _tail_action(partition_key, 0, "strategy in_place: retry every record in place", jobs)
        return _round_action(RoundKey(partition_key, 0), "input sharded", jobs)
    if asset_key in (k.rejected, k.reviewed):
        key = parse_round_key(partition_key)
        kind = _text(metadata, "decision")
        why = _text(metadata, "decision_reason") or ""
        if kind == "next_round":
            return _round_action(RoundKey(key.run, key.round + 1), f"after {key.round_label}: {why}", jobs)
        if kind == "tail":
            return _tail_action(key.run, key.round + 1, f"crossover after {key.round_label}: {why}", jobs)
        if kind in ("done", "exhausted"):
            return _results_action(key.run, f"{kind} after {key.round_label}: {why}", jobs)
        if kind == REVIEW_DECISION and asset_key == k.rejected:
            return None  # the sensor waits on the round's review queue
        raise ValueError(f"{asset_key.to_user_string()}[{partition_key}] carries no known decision (got {kind!r})")
    if asset_key == k.tail_retry:
        return _results_action(partition_key, "tail finished", jobs)
    return None


@dataclass
class SensorCursor:
    """Every event with storage id <= ``after`` is handled, and so are those in ``handled``.

    Serialised as the plain id while nothing above it is handled and no round waits for
    review (the common case, and the format of earlier cursors), else as JSON
    ``{"after": N, "handled": [...], "review": {partition: last reported}}``.
    """

    after: int = 0
    handled: set[int] = field(default_factory=set)
    review: dict[str, dict[str, Any]] = field(default_factory=dict)  # rounds waiting for people

    @classmethod
    def parse(cls, text: str | None) -> "SensorCursor":
        if not text:
            return cls()
        if text.lstrip().startswith("{"):
            data = json.loads(text)
            return cls(int(data["after"]), {int(i) for i in data.get("handled", [])}, dict(data.get("review", {})))
        return cls(int(text))

    def advance(self, seen: Iterable[int], *, complete: bool) -> None:
        """Move ``after`` up over the handled prefix of ``seen`` (the ids this tick fetched).

        Every unhandled event older than the newest fetched one was fetched, so handled ids
        up to it are stepped over too; all of them when the fetch was ``complete`` (nothing
        unhandled lies beyond it).
        """
        seen = set(seen)
        limit = None if complete or not seen else max(seen)
        for storage_id in sorted(seen | {i for i in self.handled if limit is None or i <= limit}):
            if storage_id not in self.handled:
                break
            self.after = storage_id
        self.handled = {i for i in self.handled if i > self.after}

    def __str__(self) -> str:
        if not self.handled and not self.review:
            return str(self.after)
        return json.dumps({"after": self.after, "handled": sorted(self.handled), "review": self.review})


def pipeline_of(partition_key: str) -> str:
    """The pipeline run a watched event belongs to (round keys read ``<run>|rNN``)."""
    return partition_key.rpartition("|")[0] or partition_key


def review_action(partition_key: str, run: str, reason: str, reopened: int = 0, jobs: PipelineJobs = _DEFAULT_JOBS) -> Action:
    """Close a round's review (its queue is empty or the timeout policy applies); once more
    (a new run key) after each time a close reopened it."""
    suffix = f"-reopened-{reopened}" if reopened else ""
    return Action(jobs.review.name, partition_key, f"{partition_key}:review{suffix}", run, reason)


def _records_since(instance: dg.DagsterInstance, after: int, skip: frozenset[int] | set[int] = frozenset(),
                   keys: Iterable[dg.AssetKey] = WATCHED) -> list[dg.EventLogRecord]:
    """The oldest watched materialisations with storage id > ``after`` not in ``skip`` (one tick's worth).

    Each key contributes at most ``MAX_EVENTS_PER_TICK`` of its oldest events; of the
    merge, the oldest ``MAX_EVENTS_PER_TICK`` are returned. Every event of any key not
    fetched is newer than all of those, so advancing the cursor to the last one handled
    loses nothing.
    """
    records: list[Any] = []
    for key in keys:
        fetched, cursor = 0, None
        while fetched < MAX_EVENTS_PER_TICK:
            page = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=key, after_storage_id=after), limit=PAGE, cursor=cursor, ascending=True
            )
            fresh = [r for r in page.records if r.storage_id not in skip]
            records.extend(fresh)
            fetched += len(fresh)
            if not page.has_more:
                break
            cursor = page.cursor
    records.sort(key=lambda r: r.storage_id)
    return records[:MAX_EVENTS_PER_TICK]


def _newest_upstream(instance: dg.DagsterInstance, deps: Iterable[dg.AssetKey]) -> dict[dg.AssetKey, int]:
    """Each upstream key's newest materialisation's storage id (keys never materialised are left out)."""
    newest: dict[dg.AssetKey, int] = {}
    for key in deps:
        page = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=1, ascending=False)
        if page.records:
            newest[key] = page.records[0].storage_id
    return newest


def start_action(record: dg.EventLogRecord, k: PipelineKeys, start_job: Any) -> Action:
    """Start a run of ``k`` over what an upstream materialisation wrote (its metadata's path):
    the run is named after the upstream's materialisation time and event id, so one upstream
    event starts one run (two events in the same second, e.g. two deps of one user run, two)."""
    from batch_inference.defs.runs.jobs import start_run_config
    from batch_inference.defs.runs.start import INPUT_METADATA_KEYS

    when = datetime.fromtimestamp(record.timestamp, tz=timezone.utc).strftime("%Y%m%dT%H%M%S")
    run = f"{'-'.join(k.prefix) or 'run'}-{when}-{record.storage_id}".replace("_", "-")
    materialization = record.asset_materialization
    drop = None
    if materialization is not None:
        for name in INPUT_METADATA_KEYS:
            value = materialization.metadata.get(name)
            if value is not None:
                drop = str(getattr(value, "value", value))
                break
    return Action(start_job.name, None, f"{run}:start", run, f"{record.asset_key.to_user_string()} materialised",  # type: ignore[arg-type]
                  run_config=start_run_config(None, run=run, input=drop, k=k))


def build_round_sensor(k: PipelineKeys, jobs: PipelineJobs, *, deps: tuple[dg.AssetKey, ...] = (),
                       start_job: Any = None) -> dg.SensorDefinition:
    """The round sensor of pipeline ``k`` (``<prefix>__round_sensor``); with ``deps``, a materialisation
    of one of them starts a run (``start_job``) over the path its metadata names."""

    @dg.sensor(
        name=k.name("round_sensor"),
        jobs=[*jobs.all, *([start_job] if start_job is not None else [])],
        minimum_interval_seconds=5,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Drives every run of {k.label}: shard, then round after round, then the tail or results (one action per step)"
        + (f"; starts a run when {', '.join(d.to_user_string() for d in deps)} is materialised" if deps else "") + ".",
    )
    def round_sensor(context: dg.SensorEvaluationContext, storage: StorageResource) -> dg.SensorResult:
        instance = context.instance
        cursor = SensorCursor.parse(context.cursor)
        known_labels = set(instance.get_dynamic_partitions(k.round_numbers.name))
        new_labels: list[str] = []
        requests = recover(context, context.sensor_name or k.name("round_sensor"), (job.name for job in jobs.all), RUN_TAG)
        requested: set[str] = {r.run_key for r in requests if r.run_key}
        waiting: set[str] = set()  # pipeline runs with an event whose Dagster run has not finished
        records = _records_since(instance, cursor.after, cursor.handled, (*watched(k), *deps))
        # a sensor's first tick starts one run over each upstream's newest materialisation, never
        # one per materialisation in its history (a component added to a project with a past)
        newest = _newest_upstream(instance, deps) if context.cursor is None else {}
        for record in records:
            key, partition = record.asset_key, record.partition_key
            if key in newest and record.storage_id < newest[key]:
                cursor.handled.add(record.storage_id)
                continue
            pipeline = pipeline_of(partition) if partition is not None else None
            if pipeline in waiting:
                continue  # keep one pipeline's events in order: after the one it waits on
            run = instance.get_run_by_id(record.run_id) if record.run_id else None  # runless: reported via the API
            if run is not None and not run.is_finished:
                if pipeline is not None:
                    waiting.add(pipeline)  # its checks may still fail: decide on a later tick
                    continue
            cursor.handled.add(record.storage_id)
            if key in deps:  # the user's upstream asset landed: start a run over what it wrote
                if start_job is not None and key not in watched(k):
                    action = start_action(record, k, start_job)
                    if action.run_key not in requested:
                        requested.add(action.run_key)
                        context.log.info(f"{key.to_user_string()} materialised -> {action.job_name}: {action.reason}")
                        requests.append(action.run_request())
                continue
            if partition is None:
                continue
            if record.run_id and (run is None or run.status != dg.DagsterRunStatus.SUCCESS):
                context.log.warning(f"{key.to_user_string()}[{partition}]: its run did not succeed; no follow-up (fix and re-materialise it)")
                continue
            materialization = record.asset_materialization
            metadata = materialization.metadata if materialization else {}
            if key == k.rejected and _text(metadata, "decision") == REVIEW_DECISION:
                cursor.review.setdefault(partition, {})
            try:
                action = follow_up(key, partition, metadata, k, jobs)
            except ValueError as exc:  # a malformed event must not wedge every other run behind it
                context.log.error(f"{key.to_user_string()}[{partition}]: no follow-up: {exc}")
                continue
            if action is None or action.run_key in requested:  # e.g. a round re-materialised twice
                continue
            requested.add(action.run_key)
            if action.new_round_label and action.new_round_label not in known_labels:
                known_labels.add(action.new_round_label)
                new_labels.append(action.new_round_label)
            context.log.info(f"{key.to_user_string()}[{partition}] -> {action.job_name}[{action.partition_key}]: {action.reason}")
            requests.append(action.run_request())
        cursor.advance((r.storage_id for r in records), complete=len(records) < MAX_EVENTS_PER_TICK)
        reviews = review_tick(instance, cursor.review, storage, k)
        cursor.review = reviews.waiting
        for partition, run_name, why, reopened in reviews.ready:
            action = review_action(partition, run_name, why, reopened, jobs)
            if action.run_key not in requested:
                requested.add(action.run_key)
                context.log.info(f"{partition} -> {action.job_name}[{partition}]: {why}")
                requests.append(action.run_request())
        for text in reviews.said:
            context.log.info(text)
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[k.round_numbers.build_add_request(new_labels)] if new_labels else [],
            asset_events=reviews.events,
            cursor=str(cursor),
            skip_reason="; ".join(reviews.said) if reviews.said and not requests else None,
        )

    return round_sensor


round_sensor = build_round_sensor(DEFAULT, _DEFAULT_JOBS)
