"""``batch-inference make-model``: build the tiny offline model."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("make-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, help="weight seed (same seed => same files)")
@click.option("--adapter-for", "adapter_for", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="build a LoRA adapter for this tiny model instead of a model (engine.vllm.lora / engine.transformers.lora adapters)")
@click.option("--rank", default=8, show_default=True, type=click.IntRange(1, 64), help="the adapter's LoRA rank")
@click.option("--embed", is_flag=True, help="build a tiny embedding model instead (engine.task / infer.task: embed; "
                                            "mean pooling, normalised, Matryoshka dimensions 32/64/128)")
def make_model(out_dir: Path, seed: int, adapter_for: Path | None, rank: int, embed: bool) -> None:
    """Build a tiny Llama model with a locally trained BPE tokenizer into OUT_DIR (no download),
    with --embed a tiny embedding model, or with --adapter-for MODEL a tiny LoRA adapter for it."""
    if adapter_for is not None:
        from batch_inference.engines.tiny_model import make_tiny_adapter

        path = make_tiny_adapter(adapter_for, out_dir, rank=rank, seed=seed)
        click.echo(f"LoRA adapter (rank {rank}) for {adapter_for} written to {path}, PEFT layout")
        return
    if embed:
        from batch_inference.engines.tiny_model import make_tiny_embedding_model

        path = make_tiny_embedding_model(out_dir, seed=seed)
        click.echo(f"tiny embedding model written to {path} (LlamaModel, mean pooling, normalised; 128 dimensions)")
        return
    from batch_inference.engines.tiny_model import make_tiny_model

    path = make_tiny_model(out_dir, seed=seed)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    click.echo(f"tiny model written to {path} ({size / 1e6:.1f} MB), save_pretrained layout")
