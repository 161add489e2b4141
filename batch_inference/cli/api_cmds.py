"""``batch-inference api serve --config api.yaml``: the OpenAI / Anthropic Batch API server."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click


@click.group("api")
def api() -> None:
    """A self-hosted OpenAI and Anthropic Batch API: point the official SDKs at it (docs/api.md)."""


@api.command("serve")
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="api.yaml: storage, tokens_file, models")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address")
@click.option("--port", default=8080, show_default=True, type=int, help="0 picks a free port")
def serve(config_path: Path, host: str, port: int) -> None:
    """Serve the Batch APIs; batches left unfinished by a previous server resume at start."""
    from batch_inference.api.batches import BatchManager
    from batch_inference.api.config import ApiConfig, ApiConfigError
    from batch_inference.api.store import Store
    from batch_inference.api.server import serve as run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ApiConfig.load(config_path)
        config.tokens()
        BatchManager(config, Store(config.storage, config.storage_options)).check_models()
    except ApiConfigError as exc:
        raise click.ClickException(str(exc)) from None

    def ready(url: str) -> None:
        click.echo(f"batch API serving {', '.join(config.models)} at {url}/v1 (storage {config.storage})", err=True)

    try:
        asyncio.run(run_server(config, host=host, port=port, ready=ready))
    except OSError as exc:
        raise click.ClickException(f"cannot serve on {host}:{port}: {exc}") from None
    except KeyboardInterrupt:
        pass
