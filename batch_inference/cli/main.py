"""The ``batch-inference`` command line.

Each command group lives in its own module beside this one and is imported only when
the CLI starts, so ``batch-inference --help`` is fast and a layer's commands fail
alone if its optional dependencies are missing.
"""

from __future__ import annotations

import importlib

import click

# module -> names of click commands it defines (registered in this order)
_COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "batch_inference.cli.storage_cmds": ("shard", "inspect"),
    "batch_inference.cli.engine_cmds": ("make_model",),
    "batch_inference.cli.pool_cmds": ("worker", "pool"),
    "batch_inference.cli.pipeline_cmds": ("run", "status", "validate", "export"),
    "batch_inference.cli.plan_cmds": ("plan", "profile"),
    "batch_inference.cli.review_cmds": ("review",),
    "batch_inference.cli.api_cmds": ("api",),
    "batch_inference.cli.demo_cmds": ("demo",),
}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="batch_inference")
def cli() -> None:
    """Batch LLM inference at scale: stream shards, batch by tokens, keep the GPU busy."""


def _register() -> None:
    for module_name, names in _COMMAND_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # a command module this install lacks: its commands are left out
                continue
            raise
        for name in names:
            command = getattr(module, name, None)
            if command is not None:
                cli.add_command(command)


_register()

if __name__ == "__main__":  # pragma: no cover
    cli()
