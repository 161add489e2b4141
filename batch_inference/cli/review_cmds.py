"""``batch-inference review SPEC_OR_RUN_URL``: serve the review page for a run's review queues."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click


@click.command("review")
@click.argument("target", metavar="SPEC_OR_RUN_URL")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (off loopback only with --reviewers)")
@click.option("--port", default=8765, show_default=True, type=int, help="0 picks a free port")
@click.option("--reviewers", "reviewers_file", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON mapping reviewer name -> token; each reviewer opens http://HOST:PORT/#token=TOKEN")
@click.option("--as", "default_reviewer", help="without --reviewers: the name verdicts are signed with (default: your user)")
@click.option("--lease", "lease", help="how long a reviewer holds a record (default: the spec's review.lease), e.g. 10m")
@click.option("--run-name", "run_name", help="override the spec's run name")
@click.option("--storage-options", "storage_options", help="JSON fsspec options for a RUN_URL (e.g. an S3 endpoint)")
def review(target: str, host: str, port: int, reviewers_file: str | None, default_reviewer: str | None,
           lease: str | None, run_name: str | None, storage_options: str | None) -> None:
    """Serve the review page for a run (its SPEC file, or the run's URL <output>/<run>):
    one record at a time, keyboard verdicts (a/r/s/u)."""
    from batch_inference.pipeline.spec import parse_duration
    from batch_inference.pipeline import SpecError
    from batch_inference.review.server import load_reviewers, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = _spec_of(target, run_name, storage_options)
        reviewers = load_reviewers(reviewers_file) if reviewers_file else None
        lease_s = parse_duration(lease) if lease else None
    except (SpecError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None

    def ready(url: str) -> None:
        click.echo(f"review page for run {spec.run}: {url}" + ("  (reviewers: open it with #token=<your token>)" if reviewers else ""),
                   err=True)

    try:
        asyncio.run(serve(spec, host=host, port=port, reviewers=reviewers, default_reviewer=default_reviewer,
                          lease_s=lease_s, ready=ready))
    except PermissionError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


def _spec_of(target: str, run_name: str | None, storage_options: str | None):  # -> PipelineSpec
    """A spec file, or a run's URL whose ledger holds the spec it ran with (secrets redacted:
    ``--storage-options`` supplies them)."""
    import orjson

    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, SpecError

    if Path(target).suffix in (".yaml", ".yml", ".toml") and Path(target).is_file():
        return PipelineSpec.load(target, run=run_name)
    options = orjson.loads(storage_options) if storage_options else {}
    base, _, name = target.rstrip("/").rpartition("/")
    layout = RunLayout(base or ".", name)
    recorded = Ledger(layout, options).read(RunLayout.SPEC)
    if recorded is None:
        raise SpecError(f"{target}: neither a spec file nor a started run (no {layout.ledger_file(RunLayout.SPEC)})")
    recorded.update(output=base or ".", run=name, storage_options=options)
    return PipelineSpec.parse(recorded, source=f"spec recorded at {layout.ledger_file(RunLayout.SPEC)}")
