"""``batch-inference run SPEC`` and ``batch-inference status RUN``.

``run`` drives a whole pipeline with a progress bar per phase; Ctrl-C stops it cleanly
(finished shards are recorded, half-written ones are never visible) and running the same
command again resumes. Exit status: 0 converged, 3 exhausted (max_rounds/max_attempts
hit: worth investigating, not a success), 4 shards quarantined (a task exhausted its
retries), 5 records failed (only records with a permanent error, e.g. a prompt too long;
no shard quarantined), 1 on error.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click
import orjson

EXIT = {"converged": 0, "exhausted": 3, "quarantined": 4, "records_failed": 5}


@click.command("run")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--strategy", type=click.Choice(["rounds", "in_place", "hybrid"]), help="override the spec's strategy")
@click.option("--run-name", "run_name", help="override the spec's run name (a new name starts a new run)")
def run(spec_path: Path, strategy: str | None, run_name: str | None) -> None:
    """Run (or resume) the pipeline SPEC (YAML/TOML) and print its ledger."""
    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, SpecError, run_pipeline
    from batch_inference.pipeline.report import RichReporter, ledger_table, output_console, run_lines
    from batch_inference.planning.progress import eta_after_round
    from batch_inference.review.lifecycle import ReviewGate

    try:
        spec = PipelineSpec.load(spec_path, strategy=strategy, run=run_name)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    layout = RunLayout(spec.output, spec.run)
    console = output_console()
    console.print(f"run [bold]{spec.run}[/] ({spec.strategy}) -> {layout.root}")
    _say_input_format(console, spec)
    try:
        with RichReporter(console) as reporter:
            summary = asyncio.run(run_pipeline(spec, reporter=reporter, eta=eta_after_round, gate=ReviewGate()))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: finished shards are recorded; run the same command again to resume")
        raise SystemExit(130) from None
    except Exception as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    view = Ledger(layout, spec.storage_options).view()
    console.print(ledger_table(view, f"run {spec.run}"))
    for line in run_lines(view):
        console.print(line)
    raise SystemExit(EXIT.get(summary.status, 1))


def _say_input_format(console: object, spec: object) -> None:
    """Say so when the input is detected as an OpenAI Batch file (input_format: auto)."""
    from batch_inference.pipeline import SpecError
    from batch_inference.pipeline.inputs import resolve_format

    try:
        fmt, detected = resolve_format(spec)  # type: ignore[arg-type]
    except (SpecError, OSError):  # a resumed run's drop may be gone: the run itself says what matters
        return
    if detected and fmt == "openai_batch":
        console.print(f"input {spec.input} is an OpenAI Batch file (detected; input_format auto): "  # type: ignore[attr-defined]
                      "custom_id becomes the record id; `batch-inference export` writes the output + error files")


@click.command("status")
@click.argument("target", metavar="RUN_URL_OR_SPEC")
@click.option("--storage-options", "storage_options", help="JSON fsspec options for a RUN_URL (e.g. an S3 endpoint)")
@click.option("--json", "as_json", is_flag=True, help="print the ledger as JSON instead of a table")
def status(target: str, storage_options: str | None, as_json: bool) -> None:
    """Print a run's ledger: per round the funnel, tokens, engine time, wall time and decision."""
    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, SpecError
    from batch_inference.pipeline.report import duration, ledger_table, output_console, run_lines

    options = orjson.loads(storage_options) if storage_options else {}
    if Path(target).suffix in (".yaml", ".yml", ".toml") and Path(target).is_file():
        try:
            spec = PipelineSpec.load(target)
        except SpecError as exc:
            raise click.ClickException(str(exc)) from None
        layout, options = RunLayout(spec.output, spec.run), spec.storage_options
    else:
        base, _, name = target.rstrip("/").rpartition("/")
        layout = RunLayout(base or ".", name)
    ledger = Ledger(layout, options)
    view = ledger.view()
    if view.shard is None and view.spec is None:
        raise click.ClickException(f"no ledger at {layout.ledger}: not a pipeline run (or not started)")
    if as_json:
        click.echo(orjson.dumps(view.as_dict(), option=orjson.OPT_INDENT_2).decode())
        return
    console = output_console()
    console.print(ledger_table(view, f"run {layout.run} ({layout.root})"))
    lines = run_lines(view)
    if view.run is None:  # an API batch's run that the server stopped is not to be re-run: its state says how it ended
        from batch_inference.api.status import batch_lines, batch_of_run
        from batch_inference.pipeline.report import input_lines

        if (batch := batch_of_run(layout.base, layout.run, options)) is not None:
            lines = [*input_lines(view), *batch_lines(batch)]
    for line in lines:
        console.print(line)
    if (recorded := ledger.read(RunLayout.PLAN)) is not None:
        from batch_inference.planning.progress import measured_phases, planned_vs_actual

        console.print(f"planned ({recorded.get('chosen')}) vs actual wall:", markup=False)
        for line in recorded.get("basis", [])[:1]:  # what the plan priced: its hardware and model
            console.print(f"  {line}", markup=False)
        for phase in planned_vs_actual(recorded, measured_phases(ledger)):
            planned = duration(phase.planned) if phase.priced else "unpriced"
            ratio = "" if (r := phase.ratio()) is None else f"  ({r:.2f}x)"
            if not phase.priced and phase.actual is not None:
                ratio = "  (not measured by the plan: no ratio)"
            console.print(f"  {phase.name:<22} {planned:>10} {duration(phase.actual):>10}{ratio}", markup=False)


@click.command("validate")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--quick", is_flag=True, help="check only the first records (do not read the whole input)")
def validate(spec_path: Path, quick: bool) -> None:
    """Prove SPEC runnable without running it, and print what a run would do.

    Builds the judge and the prompt path, renders the first records through the infer and
    judge templates, and (unless --quick) reads the whole input: records, shards, and the
    OpenAI Batch file checks. Exit 0 when the spec can run, 1 with the key and record named.
    """
    from batch_inference.pipeline import PipelineSpec, SpecError
    from batch_inference.pipeline.preflight import preflight

    try:
        spec = PipelineSpec.load(spec_path)
        plan = preflight(spec, full=not quick)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    for line in plan.lines():
        click.echo(line)
    click.echo(f"ok         {spec_path} can run")


def _run_of(target: str, storage_options: str | None) -> object:
    """A PipelineRun from a spec file or a run URL (whose ledger holds the spec)."""
    from batch_inference.pipeline import Ledger, PipelineRun, PipelineSpec, RunLayout

    if Path(target).suffix in (".yaml", ".yml", ".toml") and Path(target).is_file():
        return PipelineRun(PipelineSpec.load(target))
    options = orjson.loads(storage_options) if storage_options else {}
    base, _, name = target.rstrip("/").rpartition("/")
    recorded = Ledger(RunLayout(base or ".", name), options).read(RunLayout.SPEC)
    if recorded is None:
        raise click.ClickException(f"no ledger/spec.json under {target}: not a pipeline run (or not started)")
    recorded.update(output=base or ".", run=name, storage_options=options)
    return PipelineRun(PipelineSpec.parse(recorded, source=f"{target}/ledger/spec.json"))


@click.command("export")
@click.argument("target", metavar="RUN_URL_OR_SPEC")
@click.option("--format", "fmt", type=click.Choice(["openai_batch", "parquet"]), default="openai_batch", show_default=True)
@click.option("--out", help="folder for the files (default <run>/export/openai_batch or <run>/export/parquet)")
@click.option("--storage-options", "storage_options", help="JSON fsspec options for a RUN_URL")
def export(target: str, fmt: str, out: str | None, storage_options: str | None) -> None:
    """Write a finished run's results: OpenAI Batch output + error files (every request in one of
    them), or Parquet (every input record once, its columns with their types, plus status, result,
    error and attempts)."""
    from batch_inference.pipeline import SpecError, StepOrderError
    from batch_inference.pipeline.export import ExportError, export_openai_batch

    if fmt == "parquet":
        from batch_inference.pipeline.parquet_export import export_parquet

        try:
            done = export_parquet(_run_of(target, storage_options), out)  # type: ignore[arg-type]
        except (SpecError, StepOrderError, ExportError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{done.records} records -> {done.out_url} ({len(done.files)} file(s): "
                   f"{', '.join(f'{k} {v}' for k, v in done.by_status.items())})"
                   + (f"; {done.malformed} of the failed rows are malformed input lines (error names file:line)" if done.malformed else ""))
        for note in done.notes:
            click.echo(f"warning: {note}")
        if done.run_column != "run":
            click.echo(f"the run's fields are in column {done.run_column!r} (the input has a column 'run')")
        return
    try:
        summary = export_openai_batch(_run_of(target, storage_options), out)  # type: ignore[arg-type]
    except (SpecError, StepOrderError, ExportError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{summary.lines} input line(s) = {summary.output} answered + {summary.errors} errors"
               + (f" ({summary.malformed} of them malformed lines, each an error line naming its file:line)" if summary.malformed else ""))
    click.echo(f"{summary.output} answered -> {summary.output_url}")
    click.echo(f"{summary.errors} errors   -> {summary.errors_url}"
               + (f" ({', '.join(f'{k} {v}' for k, v in summary.errors_by_code.items())})" if summary.errors else ""))
    click.echo(f"usage: {summary.prompt_tokens} prompt + {summary.completion_tokens} completion tokens")
    for note in summary.notes:
        click.echo(f"warning: {note}")
