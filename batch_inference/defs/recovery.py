"""Crash recovery for the steps the round sensor requested: a dead step is run again.

A step run (shard, round, tail, results) whose process is SIGKILLed (a spot machine
reclaimed, the OOM killer) stays STARTED forever under the local ``DefaultRunLauncher``:
Dagster's run monitoring can only ask launchers that implement
``check_run_worker_health`` (Kubernetes, ECS, ...), and a dead run never materialises,
so the sensor would wait for it forever. Every tick the sensor therefore:

1. **finds dead runs**: a STARTED run is dead when it ran on *this* host (each step
   records ``host pid start-time`` in the run tag ``batch_inference/worker``) and every
   process Dagster or the step recorded for it is gone. A process counts as alive when
   a process with its pid exists (not a zombie) that was born no later than the moment
   it was recorded, so a reused pid never hides a death nor fakes a life. Runs from
   other hosts or with no record yet are left alone (Kubernetes: run monitoring). A
   dead run is marked FAILURE, with the reason, which frees its run-queue slot.
2. **retries infrastructure failures**: a FAILURE run of a sensor-requested step with
   no step failure (its worker died: found above, or by the code server when its run
   process exits, or by run monitoring, or it never started) is requested again as
   ``<run key>:retry-N`` with the same job, partition and config, once none of its
   recorded processes is alive (an orphaned step process may outlive its run worker);
   the steps are idempotent and resume. Never when a newer run of the same step exists
   (a person re-executed it, or the retry is already launched), never after a step
   failure (a failed blocking check must stop the run), and at most ``MAX_ATTEMPTS``
   times per step, after which the run is tagged and logged as stuck.

Stateless between ticks: run keys and "a newer run exists" make it idempotent.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import dagster as dg
import psutil

WORKER_TAG = "batch_inference/worker"
ATTEMPT_TAG = "batch_inference/attempt"
RETRY_OF_TAG = "batch_inference/retry_of"
RECOVERY_TAG = "batch_inference/recovery"
REASON_TAG = "batch_inference/reason"
RUN_KEY_TAG = "dagster/run_key"
SENSOR_TAG = "dagster/sensor_name"
PARTITION_TAG = "dagster/partition"
MAX_ATTEMPTS = 3  # retries per step, on top of its first run
CLOCK_SLACK_S = 1.0  # process start times (/proc, 10 ms ticks) vs event timestamps
FAILED_RUNS_SCANNED = 200  # the newest failed runs looked at per tick
_RETRY_SUFFIX = re.compile(r":retry-\d+$")


def record_worker(context: dg.AssetExecutionContext) -> None:
    """Tag the run with the process executing this step (first thing in every step)."""
    me = psutil.Process()
    context.instance.add_run_tags(context.run_id, {WORKER_TAG: f"{socket.gethostname()} {me.pid} {me.create_time():.3f}"})


@dataclass(frozen=True)
class Worker:
    """A process of a run: its pid and a moment at which it was known to be alive."""

    pid: int
    alive_at: float

    def is_alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return proc.create_time() <= self.alive_at + CLOCK_SLACK_S  # else: the pid was reused
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:  # it exists; whose it is we cannot tell: assume the run's
            return True


def run_workers(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[Worker] | None:
    """Every process recorded for ``run``, or None when it did not run on this host (or said nothing yet)."""
    host, _, rest = run.tags.get(WORKER_TAG, "").partition(" ")
    if host != socket.gethostname():
        return None
    pid, _, born = rest.partition(" ")
    try:
        workers = [Worker(int(pid), float(born))]
    except ValueError:  # not written by record_worker: cannot judge
        return None
    for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        data = entry.dagster_event.engine_event_data if entry.dagster_event else None
        value = data.metadata.get("pid") if data is not None else None
        if value is not None:  # the run worker, the executor, each step subprocess
            workers.append(Worker(int(value.value), entry.timestamp))
    return workers


def dead_reason(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """Why ``run`` (STARTED) is dead, or None when it is alive or cannot be judged from here."""
    workers = run_workers(instance, run)
    if not workers or any(w.is_alive() for w in workers):
        return None
    pids = sorted({w.pid for w in workers})
    return f"its run worker is gone: no process left of pids {pids} on {socket.gethostname()}"


def _has_step_failure(instance: dg.DagsterInstance, run_id: str) -> bool:
    return bool(instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE))


def _newer_run(instance: dg.DagsterInstance, run: dg.DagsterRun, created: float) -> str | None:
    """A run of the same step created after ``run`` (a re-execution or the retry), if any."""
    filters = dg.RunsFilter(job_name=run.job_name, tags={PARTITION_TAG: run.tags.get(PARTITION_TAG, "")})
    for record in instance.get_run_records(filters, limit=20):
        if record.dagster_run.run_id != run.run_id and record.create_timestamp.timestamp() > created:
            return record.dagster_run.run_id
    return None


def retry_key(run: dg.DagsterRun, attempt: int) -> str:
    return f"{_RETRY_SUFFIX.sub('', run.tags[RUN_KEY_TAG])}:retry-{attempt}"


def _retry_request(run: dg.DagsterRun, attempt: int, why: str, run_tag: str) -> dg.RunRequest:
    tags = {REASON_TAG: f"retry {attempt}/{MAX_ATTEMPTS} of run {run.run_id[:8]}: {why}"[:200],
            ATTEMPT_TAG: str(attempt), RETRY_OF_TAG: run.run_id}
    if run_tag in run.tags:
        tags[run_tag] = run.tags[run_tag]
    return dg.RunRequest(run_key=retry_key(run, attempt), job_name=run.job_name,
                         partition_key=run.tags.get(PARTITION_TAG), run_config=dict(run.run_config), tags=tags)


def fail_dead_runs(context: dg.SensorEvaluationContext, runs: dg.RunsFilter, job_names: set[str]) -> None:
    """Mark FAILURE every STARTED run in ``runs`` whose processes are all gone (step 1)."""
    instance = context.instance
    for record in instance.get_run_records(runs):
        run = record.dagster_run
        if run.job_name not in job_names or (why := dead_reason(instance, run)) is None:
            continue
        fresh = instance.get_run_by_id(run.run_id)  # its processes are gone: nothing can write after this
        if fresh is not None and fresh.status == dg.DagsterRunStatus.STARTED:
            context.log.warning(f"run {run.run_id} ({run.job_name}[{run.tags.get(PARTITION_TAG)}]): {why}; marking it failed")
            instance.report_run_failed(fresh, f"batch_inference round sensor: {why}")


def retries_due(context: dg.SensorEvaluationContext, runs: dg.RunsFilter, job_names: set[str],
                run_tag: str) -> list[dg.RunRequest]:
    """A retry request for each FAILURE run in ``runs`` that failed for want of a worker (step 2)."""
    instance = context.instance
    requests: list[dg.RunRequest] = []
    for record in instance.get_run_records(runs, limit=FAILED_RUNS_SCANNED):
        run = record.dagster_run
        if run.job_name not in job_names or RECOVERY_TAG in run.tags or RUN_KEY_TAG not in run.tags:
            continue
        if (newer := _newer_run(instance, run, record.create_timestamp.timestamp())) is not None:
            instance.add_run_tags(run.run_id, {RECOVERY_TAG: f"superseded by run {newer}"})  # re-executed or retried
            continue
        if _has_step_failure(instance, run.run_id):
            instance.add_run_tags(run.run_id, {RECOVERY_TAG: "not retried: a step failed (fix it and re-execute)"})
            continue
        if (workers := run_workers(instance, run)) and any(w.is_alive() for w in workers):
            continue  # failed, yet a step process of it still runs (its run worker died first): wait for it
        attempt = int(run.tags.get(ATTEMPT_TAG, "0")) + 1
        if attempt > MAX_ATTEMPTS:
            stuck = f"stuck: its worker died {attempt} times in a row; re-execute it by hand once the cause is fixed"
            context.log.error(f"run {run.run_id} ({run.job_name}[{run.tags.get(PARTITION_TAG)}]) is {stuck}")
            instance.add_run_tags(run.run_id, {RECOVERY_TAG: stuck})
            continue
        failure = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
        event = failure[-1].dagster_event if failure else None
        why = (event.message if event is not None else None) or "it failed without a step failure"
        request = _retry_request(run, attempt, why, run_tag)
        context.log.warning(f"retrying {run.job_name}[{request.partition_key}] as {request.run_key}: {why}")
        requests.append(request)
    return requests


def recover(context: dg.SensorEvaluationContext, sensor_name: str, jobs: Iterable[str],
            run_tag: str) -> list[dg.RunRequest]:
    """Mark this tick's dead runs failed, then the retries due (see the module doc)."""
    ours, job_names = {SENSOR_TAG: sensor_name}, set(jobs)
    fail_dead_runs(context, dg.RunsFilter(tags=ours, statuses=[dg.DagsterRunStatus.STARTED]), job_names)
    return retries_due(context, dg.RunsFilter(tags=ours, statuses=[dg.DagsterRunStatus.FAILURE]), job_names, run_tag)
