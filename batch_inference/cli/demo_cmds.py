"""``batch-inference demo``: a whole multi-round pipeline run through the Dagster definitions.

Offline and small enough for a laptop (a few hundred records, the tiny random Llama on
CPU): it builds the model and an input under ``.demo/``, starts a pipeline run with the
``start_pipeline_run`` job, then ticks the real round sensor and executes every run it
requests (rounds, the tail, results), exactly what ``dagster dev``'s daemon would do, and
prints the ledger. The Dagster instance is kept in ``.demo/dagster_home`` so the runs,
materialisations and checks can be browsed afterwards with ``dagster dev``.

The judge is a rule (a regex over the generated text) and sampling uses temperature 1.0,
so the random model approves some records and a retry samples differently: the run
shows rounds shrinking the pending set, then the in-place tail finishing it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import click

WORDS = ["apple", "river", "stone", "cloud", "maple", "ember", "quartz", "violet", "harbor", "tundra", "lantern", "meadow"]


def write_demo_input(path: Path, records: int) -> Path:
    """``records`` prompts as JSONL (ids q00000...), written atomically."""
    import orjson

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        for i in range(records):
            topic = WORDS[i % len(WORDS)]
            f.write(orjson.dumps({"id": f"q{i:05d}", "topic": topic, "prompt": f"Write one line about the {topic} number {i}."}) + b"\n")
    tmp.replace(path)
    return path


def demo_spec(root: Path, model_dir: Path, input_path: Path, run: str) -> dict[str, Any]:
    """The demo's pipeline spec: hybrid, three rounds at most, then in-place retry."""
    return {
        "run": run,
        "input": str(input_path),
        "output": str(root / "runs"),
        "engine": {"kind": "transformers", "model": str(model_dir), "device": "cpu", "num_threads": 1},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 12, "temperature": 1.0, "seed": 7}},
        # Random weights write random text: a record passes when its output holds two
        # "e"s (about 45% of samples), so each round and each retry approves about half.
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "e.*e"}},
        "strategy": "hybrid",
        "max_rounds": 3,
        "max_attempts": 12,
        # Stay on rounds until the cap, then hand the stubborn tail to in-place retry.
        "crossover": {"min_shrink": 0.0, "compare_cost": False},
        "shard_records": 60,
        "chunk_size": 30,
        "pool": {"launcher": "inprocess", "concurrency": 4},
    }


def embed_demo_spec(root: Path, model_dir: Path, input_path: Path, run: str) -> dict[str, Any]:
    """The ``--embed`` demo's spec: one vector per prompt on the tiny embedding model, no judge,
    exported as Parquet (``run.result``: ``fixed_size_list<float32>[128]``)."""
    return {
        "run": run,
        "input": str(input_path),
        "output": str(root / "runs"),
        "engine": {"kind": "transformers", "model": str(model_dir), "device": "cpu", "num_threads": 1},
        "infer": {"task": "embed", "template": "{prompt}"},
        "export": ["parquet"],
        "shard_records": 60,
        "chunk_size": 30,
        "pool": {"launcher": "inprocess", "concurrency": 4},
    }


@click.command("demo")
@click.option("--dir", "root", default=".demo", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="where the model, input, runs and Dagster instance go")
@click.option("--records", default=300, show_default=True, type=click.IntRange(1, 100_000), help="input records")
@click.option("--run-name", "run_name", help="pipeline run name (default: demo-<UTC time>)")
@click.option("--ephemeral", is_flag=True, help="use an in-memory Dagster instance instead of DIR/dagster_home")
@click.option("--embed", is_flag=True, help="embed the prompts with the tiny embedding model instead (infer.task: embed), "
                                            "exported as Parquet vectors")
def demo(root: Path, records: int, run_name: str | None, ephemeral: bool, embed: bool) -> None:
    """Run a whole multi-round pipeline through the Dagster definitions, offline, and print its ledger."""
    import yaml
    from batch_inference.pipeline.report import output_console

    console = output_console()
    _quiet_model_loading()
    root = root.resolve()
    model_dir = root / ("embed-model" if embed else "model")
    if not (model_dir / "config.json").exists():
        from batch_inference.engines.tiny_model import make_tiny_embedding_model, make_tiny_model

        console.print(f"building the tiny offline {'embedding ' if embed else ''}model in {model_dir}")
        (make_tiny_embedding_model if embed else make_tiny_model)(model_dir, seed=0)
    input_path = root / "input" / "prompts.jsonl"
    write_demo_input(input_path, records)
    run = run_name or time.strftime("demo-%Y%m%d-%H%M%S", time.gmtime())
    spec_path = root / "spec.yaml"
    spec_path.write_text(yaml.safe_dump((embed_demo_spec if embed else demo_spec)(root, model_dir, input_path, run), sort_keys=False))
    summary = run_demo(root, spec_path, run, ephemeral=ephemeral, console=console)
    if embed:
        parquet = root / "runs" / run / "export" / "parquet"
        console.print(f"vectors: {parquet} — load them with "
                      f"pyarrow.parquet.read_table('{parquet}')['run'].combine_chunks().field('result') (fixed_size_list<float32>[128])")
    raise SystemExit(0 if summary.get("status") in ("converged", "exhausted") else 1)


def _quiet_model_loading() -> None:
    """transformers draws a progress bar per model load (one per step here): hide it."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the cpu extra is missing: the model build below says so
        return
    hf_logging.disable_progress_bar()


def run_demo(root: Path, spec_path: Path, run: str, *, ephemeral: bool, console: Any) -> dict[str, Any]:
    """Start ``run`` and drive it to the end through the Dagster definitions; print the ledger."""
    import dagster as dg

    from batch_inference.definitions import build_definitions
    from batch_inference.defs.driver import drive, start_run
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.defs.runs.jobs import start_run_config
    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout
    from batch_inference.pipeline.report import ledger_table, run_lines

    home = root / "dagster_home"
    if ephemeral:
        instance = dg.DagsterInstance.ephemeral()
    else:
        home.mkdir(parents=True, exist_ok=True)
        instance = dg.DagsterInstance.local_temp(tempdir=str(home))
    defs = build_definitions(pool=PoolResource(mode="inprocess"), schedule_spec=str(spec_path))
    logging.getLogger("dagster").setLevel(logging.WARNING)  # the table below tells the story
    # Earlier demo runs in a kept instance are finished: the sensor starts after them.
    cursor = instance.event_log_storage.get_maximum_record_id()
    t0 = time.perf_counter()
    console.print(f"pipeline run [bold]{run}[/]: {spec_path}")
    started = start_run(defs, instance, start_run_config(str(spec_path)), log_level="WARNING")
    if not started.success:
        raise click.ClickException(f"start_pipeline_run failed for {run}")

    def show(launched: Any) -> None:
        mark = "[green]ok[/]" if launched.success else f"[red]FAILED[/] {launched.error}"
        console.print(f"  {time.perf_counter() - t0:6.1f}s  {launched.job_name:<12} {launched.partition_key:<28} {mark}",
                      highlight=False)

    result = drive(defs, instance, cursor=str(cursor) if cursor else None, on_launch=show, log_level="WARNING")
    failed = [r for r in result.launched if not r.success]
    spec = PipelineSpec.load(spec_path)
    view = Ledger(RunLayout(spec.output, spec.run), spec.storage_options).view()
    console.print(ledger_table(view, f"pipeline run {run}: {len(result.launched)} Dagster runs, {result.ticks} sensor ticks"))
    for line in run_lines(view):
        console.print(line)
    if failed:
        console.print(f"[red]{len(failed)} Dagster run(s) failed[/]: {[f'{r.job_name}[{r.partition_key}]' for r in failed]}")
    if not ephemeral:
        console.print(f"browse it: make dev  (DAGSTER_HOME={home} dagster dev -h 127.0.0.1 -w workspace.yaml)")
    return view.run.as_dict() if view.run else {}
