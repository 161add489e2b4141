"""``batch-inference plan SPEC`` and ``batch-inference profile SPEC``.

``profile`` runs a sample of the spec's input through the real pipeline on this hardware
and writes the measured per-record costs to a JSON file; ``plan`` prices the whole input
per strategy (tokens, engine time, wall, waves, GPU-hours, cost) by simulating it on that
profile, or on a calibrated decode-step profile when none is given, and prints every
assumption it made.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


def _load_spec(spec_path: Path, **overrides: object):  # type: ignore[no-untyped-def]
    from batch_inference.pipeline import PipelineSpec, SpecError

    try:
        return PipelineSpec.load(spec_path, **overrides)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("profile")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--records", type=int, default=10_000, show_default=True, help="sample size (the input's first records)")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=Path("engine-profile.json"),
              show_default=True, help="where to write the profile")
def profile(spec_path: Path, records: int, out: Path) -> None:
    """Measure SPEC's engine and pipeline on this hardware (a short real run on a sample)."""
    from batch_inference.planning.profiling import run_measure_profile

    spec = _load_spec(spec_path)
    click.echo(f"profiling {spec.run}: {records:,} records through the real pipeline ({spec.engine.kind}, {spec.pool.launcher})")
    try:
        prof = run_measure_profile(spec, records=records)
    except Exception as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    prof.save(out)
    click.echo(f"per record: infer {prof.infer_s * 1000:.3f} ms, judge {prof.judge_s * 1000:.3f} ms, "
               f"in-place attempt {prof.tail_attempt_s * 1000:.3f} ms; output tokens {prof.output_tokens:.1f}; "
               f"approval {prof.approval:.3f}")
    click.echo(f"wrote {out}: use it with `batch-inference plan {spec_path} --profile {out}`")


@click.command("plan")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--gpus", type=int, help="replicas to plan for (default: the spec's pool.replicas)")
@click.option("--gpu-hour-price", "price", type=float, help="price of one GPU-hour, for the cost column")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="an engine profile from `batch-inference profile` (default: a calibrated decode-step profile)")
@click.option("--engine-profile", "gpu_profile", help="calibrated decode-step profile (h200-llama-8b, h200-llama-1b, h100-llama-8b, vllm-cpu-tiny)")
@click.option("--approval", type=float, help="P(approved) per attempt (default: measured by the profile, else 0.5)")
@click.option("--records", type=int, help="input size (default: the manifest, a count, or an estimate from a sample)")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--record", is_flag=True, help="write the plan into the run's ledger (status and the ETA show planned vs actual)")
def plan(spec_path: Path, gpus: int | None, price: float | None, profile_path: Path | None, gpu_profile: str | None,
         approval: float | None, records: int | None, as_json: bool, record: bool) -> None:
    """Price SPEC before running it: tokens, engine time, wall, waves, GPU-hours and cost per strategy."""
    from rich.console import Console
    from rich.table import Table

    from batch_inference.pipeline.report import duration
    from batch_inference.planning.plan import make_plan
    from batch_inference.planning.profiling import EngineProfile

    spec = _load_spec(spec_path)
    try:
        prof = EngineProfile.load(profile_path) if profile_path else None
        p = make_plan(spec, gpus=gpus, gpu_hour_price=price, profile=prof, gpu_profile=gpu_profile, approval=approval, records=records)
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    if record:
        from batch_inference.pipeline import Ledger, RunLayout

        Ledger(RunLayout(spec.output, spec.run), spec.storage_options).write(RunLayout.PLAN, p.as_dict())
    if as_json:
        click.echo(json.dumps(p.as_dict(), indent=2))
        return
    console = Console(width=None if Console().is_terminal else 160)
    for line in p.basis:  # first: what hardware and model the figures are for
        console.print(line, markup=False)
    table = Table(title=f"plan for {spec.run}: {p.records:,} records on {p.replicas} replica(s) x {p.concurrency}")
    banded = any(s.wall_band_s for s in p.strategies)
    pooled = any(s.pools for s in p.strategies)  # a judge with its own pool: each pool's GPU-hours
    cols = ("strategy", "tokens in", "tokens out", "engine", "wall", *(("wall 95% band",) if banded else ()),
            "waves", "GPU-h", *(("GPU-h infer / judge",) if pooled else ()), "cost", "approved", "unfinished")
    for col in cols:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for s in p.strategies:
        mark = " (spec)" if s.strategy == p.chosen else ""
        table.add_row(
            s.strategy + mark, f"{s.tokens_in:,.0f}", f"{s.tokens_out:,.0f}", duration(s.engine_s), duration(s.wall_s),
            *((("-" if s.wall_band_s is None else f"{duration(s.wall_band_s[0])} - {duration(s.wall_band_s[1])}"),) if banded else ()),
            f"{s.waves:.1f}", f"{s.gpu_hours:,.1f}",
            *((" / ".join(f"{s.pools[k]['gpu_hours']:,.1f} ({s.pools[k]['busy_share']:.0%} busy)" for k in ("infer", "judge")),)
              if pooled else ()),
            "-" if s.cost is None else f"{s.cost:,.2f}", f"{s.approved:,}", f"{s.unfinished:,}",
        )
    console.print(table)
    best = min(p.strategies, key=lambda s: s.wall_s)
    console.print(f"fastest: [bold]{best.strategy}[/] ({duration(best.wall_s)}); the spec's hybrid decisions: "
                  + ("; ".join(p.for_strategy("hybrid").decisions) or "-"))
    if (x := p.prefix) is not None:
        line = (f"prefix cache: ideal hit rate {x['ideal_hit_rate']:.1%} of inferred prompt tokens "
                f"(~{x['family']:,.1f} records per shared prefix)")
        if x.get("gpu_hours_saved") is not None:
            cost = f", {x['cost_saved']:,.2f} saved" if x.get("cost_saved") is not None else ""
            line += (f"; the engine's cache supplies {x['hit_rate']:.1%}: {x['strategy']} takes {x['gpu_hours_saved']:,.1f} "
                     f"GPU-h less ({x['gpu_hours_without']:,.1f} without it){cost}, {duration(x['wall_s_saved'])} less wall")
        console.print(line)
    console.print("[bold]assumptions[/]")
    for line in p.assumptions:
        console.print(f"  - {line}")
