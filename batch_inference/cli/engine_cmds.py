"""``batch-inference make-model``: build the tiny offline model."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("make-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, help="weight seed (same seed => same files)")
def make_model(out_dir: Path, seed: int) -> None:
    """Build a tiny Llama model with a locally trained BPE tokenizer into OUT_DIR (no download)."""
    from batch_inference.engines.tiny_model import make_tiny_model

    path = make_tiny_model(out_dir, seed=seed)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    click.echo(f"tiny model written to {path} ({size / 1e6:.1f} MB), save_pretrained layout")
