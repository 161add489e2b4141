"""Starting a pipeline run as a job: what a schedule, the round sensor, the CLI or a person launches.

Schedules cannot add dynamic partitions, and a run's assets cannot be materialised
before its partition exists; so this job validates the spec, adds the run's partition
and records the source drop (with the spec as metadata) on ``source_dataset[<run>]``
(``runs.start``, the same body as materialising ``source_dataset`` for a new partition).
The round sensor sees that and drives the run from there. One job per pipeline.
"""


import dagster as dg
from pydantic import Field

from batch_inference.defs.keys import CPU_OP_TAGS, DEFAULT, PipelineKeys
from batch_inference.defs.runs.start import (
    SpecSource,
    already_started,
    default_output,
    ensure_gpu_pool,
    start_metadata,
    validated_spec,
)
from batch_inference.defs.storage.resources import StorageResource


class StartRunConfig(dg.Config):
    """A spec file (else the pipeline's own spec) and the per-run overrides a schedule or a person fills in."""

    spec_path: str | None = Field(None, description="the pipeline spec (.yaml/.yml/.toml); default: the pipeline's own")
    run: str | None = Field(None, description="run name (overrides the spec's): the run's partition and folder")
    input: str | None = Field(None, description="input URL (overrides the spec's), e.g. tonight's drop")
    output: str | None = Field(None, description="output base URL (overrides the storage resource's base_url, which overrides the spec's)")
    plan: bool = Field(True, description="price the run (planning.plan) and record the plan: metadata here, ledger for planned vs actual")
    plan_profile: str | None = Field(None, description="an engine profile from `batch-inference profile` for the plan")


def build_start_job(k: PipelineKeys, spec_source: SpecSource | None = None) -> dg.JobDefinition:
    """``start_pipeline_run`` of pipeline ``k`` (``<prefix>__start_pipeline_run``)."""

    @dg.op(name=k.name("start_run"), tags=CPU_OP_TAGS)
    def start_pipeline_run_op(context: dg.OpExecutionContext, config: StartRunConfig, storage: StorageResource) -> None:
        """Validate the spec (preflight: judge built, first records rendered), add the run's partition,
        record its source drop. A spec error fails this job, before any round is requested."""
        source: SpecSource | str | None = config.spec_path or spec_source
        if source is None:
            raise dg.Failure("no spec: set spec_path in the config")
        spec, plan = validated_spec(source, storage, run=config.run, input=config.input, output=config.output or storage.base_url,
                                    fallback_output=default_output(context.instance, k))
        if spec.run in context.instance.get_dynamic_partitions(k.runs.name) and already_started(context.instance, k, spec.run, by_run_id=context.run_id):
            raise dg.Failure(f"pipeline run {spec.run!r} was already started; give the new run another name (`run:` in the config)")
        ensure_gpu_pool(context.instance, context.log)
        context.instance.add_dynamic_partitions(k.runs.name, [spec.run])
        label = source if isinstance(source, str) else (source.path or source.describe())
        context.log_event(dg.AssetMaterialization(
            asset_key=k.source,
            partition=spec.run,
            description=f"input drop of pipeline run {spec.run}",
            metadata=start_metadata(context, spec, plan, spec_label=label, make_plan=config.plan, plan_profile=config.plan_profile),
        ))
        context.log.info("started pipeline run %s over %s; the round sensor takes it from here", spec.run, spec.input)

    @dg.job(name=k.name("start_pipeline_run"), tags={"batch_inference/compute": "cpu"},
            description=f"Start a run of {k.label} over an input: adds its partition and records its spec; the round sensor drives it.")
    def start_pipeline_run() -> None:
        start_pipeline_run_op()

    return start_pipeline_run


start_pipeline_run = build_start_job(DEFAULT)  # the project's own pipeline: spec_path in the config


def start_run_config(spec_path: str | None, *, run: str | None = None, input: str | None = None,
                     output: str | None = None, plan: bool | None = None, k: PipelineKeys = DEFAULT) -> dict:
    """The run config of pipeline ``k``'s ``start_pipeline_run`` (for schedules, the sensor, the CLI and tests).

    ``plan``: price the run at its start (``planning.plan``: sizing, the layout's timing, a
    simulation) before its first shard; None keeps the job's default (on). A caller that
    starts many small runs and estimates them itself (the Batch API server) turns it off."""
    cfg = {key: v for key, v in {"spec_path": spec_path, "run": run, "input": input, "output": output,
                                 "plan": plan}.items() if v is not None}
    return {"ops": {k.name("start_run"): {"config": cfg}}}
