"""``batch-inference worker`` (one worker process) and ``batch-inference pool up|status|down``.

Heavy imports happen inside the commands, so ``batch-inference --help`` stays fast and a
worker spawned by the local launcher (``python -m batch_inference.cli.pool_cmds``)
imports only what serving needs.
"""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--engine-config", "engine_config", required=True, type=click.Path(exists=True, dir_okay=False),
              help="EngineConfig as YAML or JSON.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address; off loopback a token is required.")
@click.option("--port", default=8700, show_default=True, type=int, help="0 picks a free port (see --ready-file).")
@click.option("--concurrency", default=10, show_default=True, type=int, help="Shard tasks at once (task slots).")
@click.option("--storage-root", "storage_roots", multiple=True, help="URL prefix tasks may read/write (repeatable; default: cwd).")
@click.option("--storage-options", "storage_options", type=click.Path(exists=True, dir_okay=False), default=None,
              help="YAML/JSON: profile name -> fsspec storage options (credentials stay on the worker).")
@click.option("--token-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Bearer token file (e.g. a mounted secret); else $BATCH_INFERENCE_TOKEN.")
@click.option("--idle-ttl-s", type=float, default=None, help="Exit after this long with no task.")
@click.option("--grace-s", type=float, default=30.0, show_default=True, help="SIGTERM: time running tasks get to finish.")
@click.option("--ready-file", default=None, help="Write {pid, port} here once serving.")
@click.option("--allow-rule-module", "rule_modules", multiple=True,
              help="Module whose functions tasks may name as rule judges ('module:fn'); repeatable. Built-ins always.")
@click.option("--checkpoint-interval-s", type=float, default=5.0, show_default=True, help="Retry-task checkpoint flush period.")
@click.option("--judge-endpoint", "judge_endpoints", multiple=True,
              help="A worker of the judge's own pool (repeatable): where retry tasks judge when the judge has its own model.")
@click.option("--judge-token-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The judge pool's bearer token file; else $BATCH_INFERENCE_JUDGE_TOKEN.")
@click.option("--judge-concurrency", type=int, default=10, show_default=True,
              help="Judge tasks in flight per --judge-endpoint (a Service in front of the judge pool: its replicas x concurrency).")
@click.option("--target-batch-tokens", type=int, default=12_800, show_default=True)
@click.option("--max-batch-size", type=int, default=256, show_default=True)
@click.option("--batch-timeout-s", type=float, default=0.05, show_default=True)
@click.option("--prefetch-batches", type=int, default=2, show_default=True)
@click.option("--max-queue-size", type=int, default=5_000, show_default=True)
def worker(engine_config: str, host: str, port: int, concurrency: int, storage_roots: tuple[str, ...],
           storage_options: str | None, token_file: str | None, idle_ttl_s: float | None, grace_s: float,
           ready_file: str | None, rule_modules: tuple[str, ...], checkpoint_interval_s: float,
           judge_endpoints: tuple[str, ...], judge_token_file: str | None, judge_concurrency: int, target_batch_tokens: int, max_batch_size: int,
           batch_timeout_s: float, prefetch_batches: int, max_queue_size: int) -> None:
    """Run one persistent worker: the engine loads once and serves shard tasks over HTTP."""
    import os

    from batch_inference.pool.engine_host import BatcherOptions
    from batch_inference.pool.worker import JUDGE_TOKEN_ENV, WorkerSettings, check_security, read_token, run_worker

    settings = WorkerSettings(
        host=host, port=port, concurrency=concurrency, storage_roots=list(storage_roots) or [os.getcwd()],
        token=read_token(token_file), idle_ttl_s=idle_ttl_s, grace_s=grace_s, ready_file=ready_file,
        checkpoint_interval_s=checkpoint_interval_s, rule_modules=list(rule_modules),
        judge_endpoints=list(judge_endpoints), judge_concurrency=judge_concurrency,
        judge_token=read_token(judge_token_file) if judge_token_file else os.environ.get(JUDGE_TOKEN_ENV) or None,
    )
    try:
        check_security(settings)
    except PermissionError as exc:
        raise click.ClickException(str(exc)) from exc
    batcher = BatcherOptions(target_batch_tokens=target_batch_tokens, max_batch_size=max_batch_size,
                             batch_timeout_s=batch_timeout_s, prefetch_batches=prefetch_batches,
                             max_queue_size=max_queue_size)
    run_worker(engine_config, settings, batcher=batcher, storage_profiles_file=storage_options)


def _launcher(engine_config: str | None, simulated: bool, replicas: int, concurrency: int, storage_roots: tuple[str, ...],
              idle_ttl_s: float | None, name: str, state_dir: str | None):
    """The pool's launcher. An engine is required: the simulated engine writes made-up
    text (benchmarks, tests), so it is never a default, only asked for by name."""
    from batch_inference.pool.launchers.local import LocalLauncher
    from batch_inference.pool.worker import load_config_file

    if engine_config and simulated:
        raise click.UsageError("give --engine-config FILE or --simulated-engine, not both")
    if not engine_config and not simulated:
        raise click.UsageError("pool up needs --engine-config FILE: the model the workers serve (EngineConfig YAML/JSON). "
                               "--simulated-engine starts the simulated engine instead, which writes made-up text "
                               "(benchmarks and tests only)")
    cfg = load_config_file(engine_config) if engine_config else {"kind": "simulated"}
    return LocalLauncher(cfg, replicas=replicas, concurrency=concurrency, storage_roots=list(storage_roots) or None,
                         idle_ttl_s=idle_ttl_s, name=name, state_dir=state_dir)


_pool_options = [
    click.option("--name", default="default", show_default=True, help="Pool name (one state file per name)."),
    click.option("--state-dir", default=None, help="Where pool state lives (default $BATCH_INFERENCE_POOL_DIR or ~/.cache)."),
]


def _with(options):
    def deco(f):
        for opt in reversed(options):
            f = opt(f)
        return f
    return deco


@click.group()
def pool() -> None:
    """Manage a local pool of persistent workers (reused across runs while it lives)."""


@pool.command("up")
@click.option("--engine-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="EngineConfig YAML/JSON: the model the workers serve (required unless --simulated-engine).")
@click.option("--simulated-engine", "simulated", is_flag=True,
              help="Serve the simulated engine (made-up text: benchmarks and tests only) instead of a model.")
@click.option("--replicas", default=2, show_default=True, type=int)
@click.option("--concurrency", default=10, show_default=True, type=int)
@click.option("--storage-root", "storage_roots", multiple=True, help="Repeatable; default: cwd.")
@click.option("--idle-ttl-s", type=float, default=600.0, show_default=True)
@_with(_pool_options)
def pool_up(engine_config: str | None, simulated: bool, replicas: int, concurrency: int, storage_roots: tuple[str, ...],
            idle_ttl_s: float, name: str, state_dir: str | None) -> None:
    """Start the pool, or reuse it if it is already running with the same configuration
    (one of another configuration is replaced, and this says what differed)."""
    launcher = _launcher(engine_config, simulated, replicas, concurrency, storage_roots, idle_ttl_s, name, state_dir)
    endpoints = launcher.up()
    if launcher.replaced:
        click.echo(f"pool {name}: {launcher.replaced}", err=True)
    for endpoint in endpoints:
        click.echo(endpoint)


@pool.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with(_pool_options)
def pool_status(as_json: bool, name: str, state_dir: str | None) -> None:
    """Show the recorded workers and whether they answer."""
    from batch_inference.pool.launchers.local import LocalLauncher

    rows = LocalLauncher(None, name=name, state_dir=state_dir).status()
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in rows], indent=2))
        return
    if not rows:
        click.echo(f"pool {name}: no workers")
    for r in rows:
        state = "healthy" if r.healthy else ("alive, not answering" if r.alive else "dead")
        click.echo(f"replica {r.replica}  pid {r.pid}  {r.endpoint}  {state}  loads={r.detail.get('engine_loads', '-')}")


@pool.command("down")
@_with(_pool_options)
def pool_down(name: str, state_dir: str | None) -> None:
    """Stop every worker of the pool (SIGTERM, then SIGKILL after the grace period)."""
    from batch_inference.pool.launchers.local import LocalLauncher

    n = LocalLauncher(None, name=name, state_dir=state_dir).down()
    click.echo(f"pool {name}: stopped {n} worker(s)")


@pool.command("k8s-manifests")
@click.option("--engine-config", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--image", required=True, help="Container image with batch_inference installed.")
@click.option("--name", default="batch-inference-worker", show_default=True)
@click.option("--namespace", default="default", show_default=True)
@click.option("--replicas", default=2, show_default=True, type=int)
@click.option("--concurrency", default=10, show_default=True, type=int)
@click.option("--gpus", default=1, show_default=True, type=int, help="nvidia.com/gpu per worker (0: CPU).")
@click.option("--storage-root", "storage_roots", multiple=True, required=True, help="Repeatable, e.g. s3://bucket/runs.")
@click.option("--storage-secret", default=None, help="Secret with storage credentials (envFrom), e.g. AWS_* keys.")
@click.option("--judge-engine-config", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The judge's own model: also render its pool, <name>-judge, and wire these workers to it.")
@click.option("--judge-replicas", default=None, type=int, help="The judge pool's replicas (default: --replicas).")
@click.option("--judge-concurrency", default=None, type=int, help="The judge pool's task slots per worker (default: --concurrency).")
@click.option("--judge-gpus", default=None, type=int, help="nvidia.com/gpu per judge worker (default: --gpus).")
def pool_k8s_manifests(engine_config: str, image: str, name: str, namespace: str, replicas: int, concurrency: int,
                       gpus: int, storage_roots: tuple[str, ...], storage_secret: str | None, judge_engine_config: str | None,
                       judge_replicas: int | None, judge_concurrency: int | None, judge_gpus: int | None) -> None:
    """Print the Kubernetes manifests (Secret, ConfigMap, Deployment, Service) for a worker pool.

    With ``--judge-engine-config``: the judge pool's first (named ``<name>-judge``, as the
    pipeline spec's ``judge.pool.k8s_name`` defaults), then the infer pool, whose workers
    judge their in-place tail there."""
    from typing import Any

    from batch_inference.pool.launchers.k8s import K8sLauncher, render_yaml
    from batch_inference.pool.worker import load_config_file

    common: dict[str, Any] = {"image": image, "namespace": namespace, "storage_roots": list(storage_roots), "storage_secret": storage_secret}
    judge = None if judge_engine_config is None else K8sLauncher(
        load_config_file(judge_engine_config), name=f"{name}-judge", replicas=replicas if judge_replicas is None else judge_replicas,
        concurrency=concurrency if judge_concurrency is None else judge_concurrency,
        gpus=gpus if judge_gpus is None else judge_gpus, **common)
    launcher = K8sLauncher(load_config_file(engine_config), name=name, replicas=replicas, concurrency=concurrency, gpus=gpus,
                           judge=judge, **common)
    click.echo(render_yaml(*([judge] if judge is not None else []), launcher), nl=False)


if __name__ == "__main__":  # the local launcher spawns workers this way (cheap imports)
    worker()
