"""``BatchInferenceComponent``: one batch inference pipeline from one ``defs.yaml``.

A thin layer over ``defs.pipeline.build_pipeline_definitions`` (which calls the
``PipelineRun`` steps): it resolves the YAML attributes into a spec source, the asset-key
prefix (default: the component's folder name), the upstream deps, the schedule and the
automation condition, and merges in the shared resources (the same objects for every
instance, so two pipelines in one project merge).

    type: batch_inference.BatchInferenceComponent
    attributes:
      spec_file: spec.yaml            # or spec: {...} inline (relative paths from this folder)
                                      # no output: $DAGSTER_HOME/storage/batch_inference/<prefix>/<run>
      asset_key_prefix: scoring       # default: this folder's name
      deps: [raw_prompts]             # a materialisation of it starts a run over the path in its metadata
      schedule: {cron: "0 2 * * *", run_name: "scoring-{date}"}
      approval_floor: 0.5
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
from dagster.components.component.component_scaffolder import DefaultComponentScaffolder
from dagster.components.component_scaffolding import scaffold_component

from batch_inference.defs.keys import PipelineKeys
from batch_inference.defs.pipeline import ScheduleSpec, build_pipeline_definitions, shared_resources
from batch_inference.defs.runs.start import SpecSource


class ScheduleModel(dg.Model):
    """The pipeline's own schedule."""

    cron: str
    run_name: str = "nightly-{date}"
    input: str | None = None
    running: bool = False


class BatchInferenceScaffolder(DefaultComponentScaffolder):
    """Writes a ``defs.yaml`` that loads as is: an inline spec on the simulated engine (swap in
    your model), the folder name as prefix, a nightly schedule (stopped until turned on). It
    sets no ``output``: a relative one would resolve inside the project's source tree
    (``src/<pkg>/defs/<name>/out``); without one, runs write under the Dagster instance's
    storage, ``$DAGSTER_HOME/storage/batch_inference/<prefix>/<run>`` (``defs.runs.start.default_output``)."""

    def scaffold(self, request: Any) -> None:
        name = Path(request.target_path).name
        scaffold_component(request, {
            "spec": {
                "input": "prompts.jsonl",  # no output: runs write under the instance's storage (default_output)
                "engine": {"kind": "simulated", "simulated": {"approval_rate": 0.8}},
                "infer": {"template": "{prompt}", "sampling": {"max_tokens": 32, "temperature": 1.0, "seed": 1}},
                "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
                "strategy": "hybrid",
                "max_rounds": 3,
            },
            "schedule": {"cron": "0 2 * * *", "run_name": f"{name}-{{date}}"},
        })


PLACEHOLDER_RUN = "defs-check"  # a spec's run name comes from the partition: any valid one checks the rest
PLACEHOLDER_URL = "/nonexistent/set-per-run"  # input or output a run is given (an upstream, the storage resource)


class ComponentSpecError(ValueError):
    """A component whose spec cannot run: raised while the definitions load (``dg check defs``)."""


def check_spec(source: SpecSource, where: Path) -> None:
    """Fail the definitions' load with ``validate``'s message when the spec cannot run, so
    ``dg check defs`` catches a misspelt key or a placeholder the data lacks instead of the
    nightly run. Cheap (``preflight(cheap=True)``): keys, types and paths, the judge built, and
    the templates rendered on the input's first ``preflight_records`` records where the input
    exists; no model, tokenizer or weights are read. Keys a run supplies (its name; the input
    an upstream names; the output the storage resource gives) may be left out."""
    from batch_inference.pipeline import SpecError, inputs
    from batch_inference.pipeline.preflight import preflight

    try:
        given = source.top_keys()
        # the keys a run supplies may be absent; the run's name always comes from its partition
        overrides = {key: PLACEHOLDER_URL for key in ("input", "output") if key not in given}
        spec = source.load(run=PLACEHOLDER_RUN, **overrides)
        if spec.input == PLACEHOLDER_URL or not _readable(spec.input):
            return  # the input comes with the run (an upstream's, the schedule's) or is not here yet: its start checks it
        if not inputs.first_numbered(spec.input, 1, spec.storage_options or None):
            return  # an empty drop folder: a run over it is refused at its start (allow_empty aside)
        preflight(spec, cheap=True)
    except SpecError as exc:
        raise ComponentSpecError(f"{where}: the pipeline's spec cannot run (as `batch-inference validate` says):\n{exc}") from None


def _readable(url: str) -> bool:
    """Whether the input is there to read now (a local path; a URL is left to the run's start:
    no network at definitions load)."""
    return "://" not in url and Path(url).exists()


@dg.scaffold_with(BatchInferenceScaffolder)
@dataclass
class BatchInferenceComponent(dg.Component, dg.Resolvable):
    """A batch inference pipeline: its assets under ``<prefix>/`` (source_dataset, sharded, the
    round assets, tail_retry, results), its runs as partitions, its sensor, schedule and checks."""

    spec: dict[str, Any] | None = None
    spec_file: str | None = None
    asset_key_prefix: str | list[str] | None = None
    deps: list[str] = field(default_factory=list)
    schedule: ScheduleModel | None = None
    automation_condition: dg.Injected[dg.AutomationCondition] | None = None
    approval_floor: float = 0.0

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        folder = Path(context.path)
        if (self.spec is None) == (self.spec_file is None):
            raise ValueError(f"{folder / 'defs.yaml'}: give exactly one of `spec` (inline) and `spec_file`")
        source = (SpecSource(inline=self.spec, base_dir=str(folder)) if self.spec is not None
                  else SpecSource(path=str((folder / str(self.spec_file)).resolve())))
        check_spec(source, folder / "defs.yaml")
        prefix = self.asset_key_prefix if self.asset_key_prefix is not None else folder.name
        parts = tuple(prefix.split("/")) if isinstance(prefix, str) else tuple(prefix)
        keys = PipelineKeys(tuple(re.sub(r"[^A-Za-z0-9_]", "_", p) for p in parts))
        schedule = ScheduleSpec(self.schedule.cron, self.schedule.run_name, self.schedule.input, self.schedule.running) \
            if self.schedule is not None else None
        return dg.Definitions.merge(
            build_pipeline_definitions(keys, source, deps=tuple(dg.AssetKey.from_user_string(d) for d in self.deps),
                                       schedule=schedule, automation_condition=self.automation_condition,
                                       approval_floor=self.approval_floor),
            shared_resources(),
        )
