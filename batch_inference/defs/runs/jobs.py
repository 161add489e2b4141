"""Starting a pipeline run: the one op job a person, the CLI or a schedule launches.

Schedules cannot add dynamic partitions, and a run's assets cannot be materialised
before its partition exists; so starting is a plain job: it validates the spec, adds
the run's partition and records the source drop (with the spec as metadata) on
``source_dataset[<run>]``. The round sensor sees that and drives the run from there.
"""

import dagster as dg
from pydantic import Field

from batch_inference.defs.keys import CPU_OP_TAGS, SOURCE
from batch_inference.defs.metadata import location
from batch_inference.defs.partitions import RUNS
from batch_inference.defs.specs import SPEC_METADATA_KEY
from batch_inference.defs.storage.resources import StorageResource


class StartRunConfig(dg.Config):
    """A spec file and the per-run overrides a schedule or a person fills in."""

    spec_path: str = Field(description="the pipeline spec (.yaml/.yml/.toml)")
    run: str | None = Field(None, description="run name (overrides the spec's): the run's partition and folder")
    input: str | None = Field(None, description="input URL (overrides the spec's), e.g. tonight's drop")
    output: str | None = Field(None, description="output base URL (overrides the storage resource's base_url, which overrides the spec's)")
    plan: bool = Field(True, description="price the run (planning.plan) and record the plan: metadata here, ledger for planned vs actual")
    plan_profile: str | None = Field(None, description="an engine profile from `batch-inference profile` for the plan")


@dg.op(name="start_run", tags=CPU_OP_TAGS)
def start_pipeline_run_op(context: dg.OpExecutionContext, config: StartRunConfig, storage: StorageResource) -> None:
    """Validate the spec (preflight: judge built, first records rendered), add the run's partition,
    record its source drop. A spec error fails this job, before any round is requested."""
    from batch_inference.pipeline import PipelineSpec, SpecError
    from batch_inference.pipeline.preflight import preflight

    overrides = {"run": config.run, "input": config.input, "output": config.output or storage.base_url}
    try:  # the step's own failure message is the spec error (a raw exception would nest it as the cause)
        spec = PipelineSpec.load(config.spec_path, **overrides)
    except SpecError as exc:
        raise dg.Failure(f"spec {config.spec_path} cannot run: {exc}") from None
    if storage.storage_options():  # the input may be on the resource's storage, as the steps will read it
        spec = spec.model_copy(update={"storage_options": {**storage.storage_options(), **spec.storage_options}})
    try:
        plan = preflight(spec)
    except SpecError as exc:
        raise dg.Failure(f"spec {config.spec_path} cannot run: {exc}") from None
    if spec.run in context.instance.get_dynamic_partitions(RUNS.name) and context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=SOURCE, asset_partitions=[spec.run]), limit=1
    ).records:
        raise dg.Failure(f"pipeline run {spec.run!r} was already started; give the new run another name (`run:` in the config)")
    context.instance.add_dynamic_partitions(RUNS.name, [spec.run])
    planned = _plan_metadata(context, spec, config) if config.plan else {}
    context.log_event(dg.AssetMaterialization(
        asset_key=SOURCE,
        partition=spec.run,
        description=f"input drop of pipeline run {spec.run}",
        metadata={
            SPEC_METADATA_KEY: dg.MetadataValue.json(spec.public_dict()),
            "input": location(spec.input),
            "output": location(spec.output),
            "strategy": dg.MetadataValue.text(spec.strategy),
            "max_rounds": dg.MetadataValue.int(spec.max_rounds),
            "engine": dg.MetadataValue.text(f"{spec.engine.kind}:{spec.engine.model or ''}"),
            "spec_path": dg.MetadataValue.path(config.spec_path),
            "input_format": dg.MetadataValue.text(plan.input_format),
            "preflight": dg.MetadataValue.md("\n".join(f"    {line}" for line in plan.lines())),
            **planned,
        },
    ))
    context.log.info("started pipeline run %s over %s; the round sensor takes it from here", spec.run, spec.input)


def _plan_metadata(context: dg.OpExecutionContext, spec: object, config: StartRunConfig) -> dict:
    """The run's plan (its own strategy) as metadata, and written to its ledger; a plan that
    cannot be made is logged, never a reason not to start."""
    from batch_inference.pipeline import Ledger, RunLayout
    from batch_inference.planning.plan import make_plan
    from batch_inference.planning.profiling import EngineProfile

    try:
        profile = EngineProfile.load(config.plan_profile) if config.plan_profile else None
        p = make_plan(spec, profile=profile, strategies=(spec.strategy,))  # type: ignore[attr-defined]
        Ledger(RunLayout(spec.output, spec.run), spec.storage_options).write(RunLayout.PLAN, p.as_dict())  # type: ignore[attr-defined]
    except Exception as exc:
        context.log.warning("no plan for run %s: %s: %s", spec.run, type(exc).__name__, exc)  # type: ignore[attr-defined]
        return {"plan.error": dg.MetadataValue.text(f"{type(exc).__name__}: {exc}")}
    meta = {k: dg.MetadataValue.float(float(v)) if isinstance(v, float) else dg.MetadataValue.int(v) if isinstance(v, int)
            else dg.MetadataValue.text(str(v)) for k, v in p.metadata().items()}
    meta["plan.assumptions"] = dg.MetadataValue.md("\n".join(f"- {a}" for a in p.assumptions))
    return meta


@dg.job(name="start_pipeline_run", tags={"batch_inference/compute": "cpu"},
        description="Start a pipeline run over an input: adds its partition and records its spec; the round sensor drives it.")
def start_pipeline_run() -> None:
    start_pipeline_run_op()


def start_run_config(spec_path: str, *, run: str | None = None, input: str | None = None,
                     output: str | None = None) -> dict:
    """The run config of ``start_pipeline_run`` (for schedules, the CLI and tests)."""
    cfg = {"spec_path": spec_path, **{k: v for k, v in {"run": run, "input": input, "output": output}.items() if v is not None}}
    return {"ops": {"start_run": {"config": cfg}}}
