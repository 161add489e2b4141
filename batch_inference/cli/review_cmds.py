"""``batch-inference review SPEC``: serve the review page for a run's review queues."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click


@click.command("review")
@click.argument("spec_path", metavar="SPEC", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (off loopback only with --reviewers)")
@click.option("--port", default=8765, show_default=True, type=int, help="0 picks a free port")
@click.option("--reviewers", "reviewers_file", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON mapping reviewer name -> token; each reviewer opens http://HOST:PORT/#token=TOKEN")
@click.option("--as", "default_reviewer", help="without --reviewers: the name verdicts are signed with (default: your user)")
@click.option("--lease", "lease", help="how long a reviewer holds a record (default: the spec's review.lease), e.g. 10m")
@click.option("--run-name", "run_name", help="override the spec's run name")
def review(spec_path: Path, host: str, port: int, reviewers_file: str | None, default_reviewer: str | None,
           lease: str | None, run_name: str | None) -> None:
    """Serve the review page for run SPEC: one record at a time, keyboard verdicts (a/r/s/u)."""
    from batch_inference.pipeline import PipelineSpec, SpecError
    from batch_inference.pipeline.spec import parse_duration
    from batch_inference.review.server import load_reviewers, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = PipelineSpec.load(spec_path, run=run_name)
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
