"""Drive pipeline runs in this process: a stand-in for the Dagster daemon.

``dagster dev`` runs the round sensor and launches what it requests. The demo and the
tests do the same thing without a daemon, through the same definitions: evaluate the
real sensor, apply its dynamic-partition requests, skip run keys already launched (as
the daemon does), execute each requested job in process, and tick again until the
sensor has nothing left to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

RUN_KEY_TAG = "dagster/run_key"
SENSOR_TAG = "dagster/sensor_name"


@dataclass
class LaunchedRun:
    """One run the sensor asked for and this driver executed."""

    job_name: str
    partition_key: str | None
    run_key: str | None
    success: bool
    run_id: str
    error: str | None = None  # the first step failure, innermost cause first


@dataclass
class DriveResult:
    launched: list[LaunchedRun] = field(default_factory=list)
    ticks: int = 0
    cursor: str | None = None


def first_error(result: dg.ExecuteInProcessResult) -> str:
    """The first failed step of a run, as ``step: Cause: message`` (the user's exception)."""
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data is not None:
            error = event.step_failure_data.error
            while error is not None and error.cause is not None:
                error = error.cause
            message = error.message.strip() if error is not None else "unknown error"
            return f"{event.step_key}: {message}"
    return "the run failed before any step did (see its event log)"


def start_run(defs: dg.Definitions, instance: dg.DagsterInstance, run_config: dict[str, Any],
              log_level: str | None = None) -> dg.ExecuteInProcessResult:
    """Execute the ``start_pipeline_run`` job (what a person or the schedule launches)."""
    loggers = {"loggers": {"console": {"config": {"log_level": log_level}}}} if log_level else {}
    return defs.resolve_job_def("start_pipeline_run").execute_in_process(run_config={**run_config, **loggers}, instance=instance)


def _already_launched(instance: dg.DagsterInstance, sensor_name: str, run_key: str | None) -> bool:
    if run_key is None:
        return False
    return bool(instance.get_run_ids(dg.RunsFilter(tags={RUN_KEY_TAG: run_key, SENSOR_TAG: sensor_name}), limit=1))


def tick(defs: dg.Definitions, instance: dg.DagsterInstance, cursor: str | None,
         sensor_name: str = "round_sensor") -> dg.SensorResult:
    """Evaluate the sensor once and apply its dynamic-partition requests, as the daemon does.

    The sensor function is called directly: Dagster's own tick evaluation validates
    partition keys through an instance *ref*, which an ephemeral instance lacks; the
    keys are validated when each job runs instead.
    """
    sensor = defs.resolve_sensor_def(sensor_name)
    resources = {k: v for k, v in (defs.resources or {}).items() if k in sensor.required_resource_keys}  # not the IO managers
    context = dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs, sensor_name=sensor_name,
                                      resources=resources)
    data = sensor(context)
    if not isinstance(data, dg.SensorResult):
        raise TypeError(f"sensor {sensor_name} returned {type(data).__name__}, expected a SensorResult")
    for event in data.asset_events or []:  # observations and check evaluations the sensor reports
        instance.report_runless_asset_event(event)
    for request in data.dynamic_partitions_requests or []:
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        else:
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
    return data


def drive(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    *,
    cursor: str | None = None,
    max_ticks: int = 100,
    sensor_name: str = "round_sensor",
    on_launch: Callable[[LaunchedRun], None] | None = None,
    log_level: str | None = None,
    only: Callable[[dg.RunRequest], bool] | None = None,
) -> DriveResult:
    """Tick the sensor and run what it requests until a tick requests nothing new.

    ``log_level`` (e.g. ``"WARNING"``) quiets the console logger of the executed runs;
    the event log in the instance keeps everything either way. ``only`` keeps the requests
    this caller executes (the API server drives each batch's partitions from its own thread).
    """
    loggers = {"loggers": {"console": {"config": {"log_level": log_level}}}} if log_level else {}
    out = DriveResult(cursor=cursor)
    for _ in range(max_ticks):
        data = tick(defs, instance, out.cursor, sensor_name)
        out.ticks += 1
        out.cursor = data.cursor or out.cursor
        fresh = [r for r in data.run_requests or []
                 if (only is None or only(r)) and not _already_launched(instance, sensor_name, r.run_key)]
        if not fresh:
            return out
        for request in fresh:
            tags = {**request.tags, SENSOR_TAG: sensor_name}
            if request.run_key is not None:
                tags[RUN_KEY_TAG] = request.run_key
            job = defs.resolve_job_def(request.job_name)
            result = job.execute_in_process(
                run_config={**request.run_config, **loggers}, instance=instance, partition_key=request.partition_key,
                tags=tags, raise_on_error=False,
            )
            launched = LaunchedRun(request.job_name, request.partition_key, request.run_key, result.success, result.run_id,
                                   None if result.success else first_error(result))
            out.launched.append(launched)
            if on_launch is not None:
                on_launch(launched)
    raise RuntimeError(f"the sensor still requested runs after {max_ticks} ticks: {out.launched[-5:]}")
