"""Starting a pipeline run: validate its spec, record it on ``source_dataset[<run>]``.

Two ways in, one body (``start_metadata``): materialising ``<prefix>/source_dataset`` for a
new partition in the UI (the partition is the run name), and the ``start_pipeline_run`` op
job that a schedule, the round sensor (an upstream asset was materialised), the CLI or a
person launches (it adds the partition first: schedules cannot). The spec comes from the
pipeline's ``SpecSource`` (a file, or a component's inline mapping) unless the job's config
names another file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field

from batch_inference.defs.keys import GPU_POOL
from batch_inference.defs.metadata import location
from batch_inference.defs.specs import SPEC_METADATA_KEY

if TYPE_CHECKING:
    from batch_inference.defs.keys import PipelineKeys
    from batch_inference.defs.storage.resources import StorageResource
    from batch_inference.pipeline import PipelineSpec

# Metadata keys of an upstream materialisation that name the input it wrote (first found wins).
INPUT_METADATA_KEYS = ("path", "uri", "dagster/uri", "input")


@dataclass(frozen=True)
class SpecSource:
    """Where a pipeline's spec comes from: a file, or an inline mapping (a component's ``spec:``)
    whose relative paths resolve from ``base_dir`` (the component's folder)."""

    path: str | None = None
    inline: Mapping[str, Any] | None = field(default=None, hash=False)
    base_dir: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.inline is None):
            raise ValueError("a pipeline's spec: give exactly one of a spec file and an inline spec")

    def describe(self) -> str:
        return f"spec {self.path}" if self.path else f"inline spec from {self.base_dir or os.getcwd()}"

    def exists(self) -> bool:
        return self.inline is not None or "://" in str(self.path) or os.path.isfile(str(self.path))

    def top_keys(self) -> set[str]:
        """The spec's own top-level keys (a file's read as ``PipelineSpec.load`` reads it; none
        when it cannot be read: loading it then says why)."""
        if self.inline is not None:
            return set(self.inline)
        import tomllib

        import yaml

        path = str(self.path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            data = tomllib.loads(text) if path.endswith(".toml") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError):
            return set()
        return set(data) if isinstance(data, dict) else set()

    def load(self, **overrides: Any) -> PipelineSpec:
        """The spec with ``overrides`` (run, input, output: None keeps the spec's) applied."""
        from batch_inference import speckeys
        from batch_inference.pipeline import PipelineSpec

        if self.path is not None:
            return PipelineSpec.load(self.path, **overrides)
        data = dict(self.inline or {})
        if self.base_dir is not None:
            data = speckeys.resolve_paths(PipelineSpec, data, os.path.abspath(self.base_dir))
        data.update({k: v for k, v in overrides.items() if v is not None})
        return PipelineSpec.parse(data, source=self.describe())


class SourceConfig(dg.Config):
    """Per-run overrides when a run is started by materialising ``source_dataset`` (all optional)."""

    input: str | None = Field(None, description="input URL; else the path an upstream asset's newest materialisation names; else the spec's")
    output: str | None = Field(None, description="output base URL (else the storage resource's base_url, else the spec's)")
    plan: bool = Field(True, description="price the run (planning.plan) and record the plan: metadata here, ledger for planned vs actual")
    plan_profile: str | None = Field(None, description="an engine profile from `batch-inference profile` for the plan")


def upstream_input(instance: dg.DagsterInstance, deps: Sequence[dg.AssetKey]) -> str | None:
    """The input path the newest materialisation of an upstream asset names in its metadata."""
    newest: tuple[float, str] | None = None
    for key in deps:
        records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key), limit=1, ascending=False).records
        if not records or records[0].asset_materialization is None:
            continue
        metadata = records[0].asset_materialization.metadata
        for name in INPUT_METADATA_KEYS:
            value = metadata.get(name)
            if value is not None and str(getattr(value, "value", value)):
                if newest is None or records[0].timestamp > newest[0]:
                    newest = (records[0].timestamp, str(getattr(value, "value", value)))
                break
    return newest[1] if newest else None


def already_started(instance: dg.DagsterInstance, k: PipelineKeys, run: str, *, by_run_id: str | None = None) -> bool:
    """Whether pipeline run ``run`` was started by another Dagster run than ``by_run_id``: the same
    Dagster run executing its start step again (resumed after its pod died, a step retry) is the
    same start, not a second one."""
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.source, asset_partitions=[run]), limit=20).records
    return any(r.run_id != by_run_id for r in records)


def ensure_gpu_pool(instance: dg.DagsterInstance, log: Any) -> None:
    """Give the GPU pool its slots before any GPU step claims one.

    Dagster creates a pool's ``default_limit`` lazily, at a step's first claim: it counts the
    pool's slots, then adds the missing ones, in one transaction per claimant. Two GPU steps
    that claim a new pool at the same moment (two pipelines' first rounds) each add the limit's
    slots, and a pool of limit 1 then runs two GPU steps at once. Every run starts here before
    its first GPU step, so the pool exists by then; a pool a user has set (``dagster instance
    concurrency set``) is never touched, and one that a race in here or in Dagster already
    doubled is cut back to its limit.
    """
    storage = instance.event_log_storage
    limit = instance.global_op_concurrency_default_limit
    if limit is None or not storage.supports_global_concurrency_limits:
        return
    if GPU_POOL not in {p.name for p in storage.get_pool_limits()}:
        storage.initialize_concurrency_limit_to_default(GPU_POOL)
    info = storage.get_concurrency_info(GPU_POOL)
    if info.using_default_limit and info.limit is not None and info.slot_count > info.limit:
        log.warning("concurrency pool %s had %d slots for a limit of %d (two first claims at once); set back to %d",
                    GPU_POOL, info.slot_count, info.limit, info.limit)
        storage.set_concurrency_slots(GPU_POOL, info.limit)


def default_output(instance: dg.DagsterInstance, k: PipelineKeys) -> str:
    """Where a pipeline's runs write when neither the spec, the run's config nor the storage
    resource says: ``<instance storage>/batch_inference/<prefix>`` (``$DAGSTER_HOME/storage/...``),
    beside the instance's own data, never inside the project's source tree."""
    return os.path.join(instance.storage_directory(), "batch_inference", k.group)


def validated_spec(source: SpecSource | str, storage: StorageResource, *, fallback_output: str | None = None,
                   **overrides: Any) -> tuple[PipelineSpec, Any]:
    """Load and preflight the spec (judge built, first records rendered); a spec error is the step's failure.
    ``fallback_output``: the output when no override gives one and the spec has none (``default_output``)."""
    from batch_inference.pipeline import PipelineSpec, SpecError
    from batch_inference.pipeline.preflight import preflight

    label = source if isinstance(source, str) else source.describe()
    if overrides.get("output") is None and fallback_output is not None:
        spec_source = SpecSource(path=source) if isinstance(source, str) else source
        if "output" not in spec_source.top_keys():
            overrides["output"] = fallback_output
    try:  # the step's own failure message is the spec error (a raw exception would nest it as the cause)
        spec = PipelineSpec.load(source, **overrides) if isinstance(source, str) else source.load(**overrides)
        if storage.storage_options():  # the input may be on the resource's storage, as the steps will read it
            spec = spec.model_copy(update={"storage_options": {**storage.storage_options(), **spec.storage_options}})
        return spec, preflight(spec)
    except SpecError as exc:
        raise dg.Failure(f"spec {label} cannot run: {exc}") from None


def start_metadata(context: dg.OpExecutionContext, spec: Any, plan: Any, *, spec_label: str, make_plan: bool,
                   plan_profile: str | None) -> dict[str, Any]:
    """What ``source_dataset[<run>]`` records: the spec (redacted) every later step reads back, and the plan."""
    planned = _plan_metadata(context, spec, plan_profile) if make_plan else {}
    return {
        SPEC_METADATA_KEY: dg.MetadataValue.json(spec.public_dict()),
        "input": location(spec.input),
        "output": location(spec.output),
        "strategy": dg.MetadataValue.text(spec.strategy),
        "max_rounds": dg.MetadataValue.int(spec.max_rounds),
        "engine": dg.MetadataValue.text(f"{spec.engine.kind}:{spec.engine.model or ''}"),
        "spec_path": dg.MetadataValue.path(spec_label),
        "input_format": dg.MetadataValue.text(plan.input_format),
        "preflight": dg.MetadataValue.md("\n".join(f"    {line}" for line in plan.lines())),
        **planned,
    }


def start_source(context: dg.AssetExecutionContext, config: SourceConfig, storage: StorageResource, source: SpecSource,
                 k: PipelineKeys, deps: Sequence[dg.AssetKey]) -> dict[str, Any]:
    """The body of ``source_dataset``: its partition key is the run's name."""
    run = context.partition_key
    if already_started(context.instance, k, run, by_run_id=context.run_id):
        raise dg.Failure(f"pipeline run {run!r} of {k.label} was already started; add a new partition (a new run name)")
    drop = config.input or upstream_input(context.instance, deps)
    spec, plan = validated_spec(source, storage, run=run, input=drop, output=config.output or storage.base_url,
                                fallback_output=default_output(context.instance, k))
    ensure_gpu_pool(context.instance, context.log)
    context.log.info("starting pipeline run %s of %s over %s; the round sensor takes it from here", run, k.label, spec.input)
    return start_metadata(context.op_execution_context, spec, plan, spec_label=source.path or source.describe(),
                          make_plan=config.plan, plan_profile=config.plan_profile)


def _plan_metadata(context: dg.OpExecutionContext, spec: Any, plan_profile: str | None) -> dict:
    """The run's plan (its own strategy) as metadata, and written to its ledger; a plan that
    cannot be made is logged, never a reason not to start."""
    from batch_inference.pipeline import Ledger, RunLayout
    from batch_inference.planning.plan import make_plan
    from batch_inference.planning.profiling import EngineProfile

    try:
        profile = EngineProfile.load(plan_profile) if plan_profile else None
        # Dagster's steps: the shard step whole, then round 0 (no round 0 beside the layout pass)
        p = make_plan(spec, profile=profile, strategies=(spec.strategy,), stream_round0=False)
        Ledger(RunLayout(spec.output, spec.run), spec.storage_options).write(RunLayout.PLAN, p.as_dict())
    except Exception as exc:
        context.log.warning("no plan for run %s: %s: %s", spec.run, type(exc).__name__, exc)
        return {"plan.error": dg.MetadataValue.text(f"{type(exc).__name__}: {exc}")}
    meta = {k: dg.MetadataValue.float(float(v)) if isinstance(v, float) else dg.MetadataValue.int(v) if isinstance(v, int)
            else dg.MetadataValue.text(str(v)) for k, v in p.metadata().items()}
    meta["plan.assumptions"] = dg.MetadataValue.md("\n".join(f"- {a}" for a in p.assumptions))
    return meta
