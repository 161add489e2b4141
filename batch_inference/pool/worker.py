"""The worker process: one engine, one batcher, ``concurrency`` shard tasks over HTTP (aiohttp).

Routes: ``POST /tasks`` (a TaskSpec; 200 TaskResult | 400 bad spec | 401 no/wrong token |
403 URL outside the storage roots | 409 task_id reused with another spec | 413 body too
large | 422 unusable input | 429 busy | 500 task error | 503 shutting down | 507 storage full),
``POST /tasks/cancel`` (``{"task_id"}``: cancels that running task and answers once it has
ended; a ``POST /tasks`` whose connection closes cancels its task too, when no other
request waits on it), ``GET /health``, ``GET /stats`` (JSON), ``GET /metrics`` (Prometheus text).

Security: binds 127.0.0.1 unless told otherwise; off loopback it refuses to start without
a bearer token (env ``BATCH_INFERENCE_TOKEN`` or a file such as a mounted Kubernetes
secret). Every URL of a task must lie under the configured storage roots. Storage
credentials come from the worker's own profiles, never from a request. JSON only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batch_inference._net import is_loopback
from batch_inference.engines import EngineConfig, EngineDeadError
from batch_inference.judges.rules import BUILTIN_RULES
from batch_inference.pool.client import PoolClient
from batch_inference.pool.engine_host import BatcherOptions, EngineHost
from batch_inference.pool.metrics import CONTENT_TYPE, worker_registry
from batch_inference.pool.protocol import TaskConflict, TaskSpec
from batch_inference.pool.failures import is_machine_error
from batch_inference.pool.runtime import Refused, WorkerRuntime
from batch_inference.pool.context import TaskInputError
from batch_inference.storage import CorruptShardError, MalformedRecordError, is_under, urls

log = logging.getLogger("batch_inference.worker")

TOKEN_ENV = "BATCH_INFERENCE_TOKEN"
JUDGE_TOKEN_ENV = "BATCH_INFERENCE_JUDGE_TOKEN"
MAX_BODY_BYTES = 1 << 20
_USERINFO = re.compile(r"://[^/@]*@")


class WorkerSettings(BaseModel):
    """How one worker process serves (the engine and batcher are configured separately)."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0: pick a free port (see ready_file)
    concurrency: int = Field(10, ge=1)
    storage_roots: list[str] = Field(default_factory=lambda: [os.getcwd()])
    token: str | None = Field(None, repr=False)
    idle_ttl_s: float | None = Field(None, gt=0)
    grace_s: float = Field(30.0, ge=0)
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1024)
    checkpoint_interval_s: float = Field(5.0, gt=0)
    ready_file: str | None = None
    # Modules whose functions a task's rule judge may name ("module:fn"); built-in rules
    # are always allowed. Importing a module a request names would run code by reference.
    rule_modules: list[str] = Field(default_factory=list)
    # The judge's own pool (its own model): where retry tasks with a judge_pool output send
    # their judge waves. Configured here, never named by a task: a task cannot make the
    # worker call an address of its choosing.
    judge_endpoints: list[str] = Field(default_factory=list)
    judge_token: str | None = Field(None, repr=False)
    judge_timeout_s: float = Field(3600.0, gt=0)
    # Judge tasks in flight per judge endpoint: a worker's own slots for a local pool's
    # workers; a Kubernetes Service stands for every judge worker, so there it is the
    # judge pool's replicas x concurrency.
    judge_concurrency: int = Field(10, ge=1)
    # The engine thread and the event loop share the GIL: with CPython's default 5 ms
    # switch interval a finished batch can wait that long behind the loop's JSON work
    # before the next one is dispatched. The worker owns its process, so it shortens it.
    gil_switch_interval_s: float | None = Field(0.001, gt=0)


def read_token(token_file: str | None = None) -> str | None:
    """The bearer token: a file (e.g. a mounted secret) wins over ``$BATCH_INFERENCE_TOKEN``."""
    if token_file:
        token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping (engine configs, storage profiles)."""
    text = Path(path).read_text()
    data = yaml.safe_load(text) if str(path).endswith((".yaml", ".yml")) else json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def config_hash(engine_config: EngineConfig, batcher: BatcherOptions, concurrency: int, storage_roots: list[str],
                judge_endpoints: list[str] | None = None) -> str:
    """Identity of a worker's configuration: a launcher reuses a running pool only if it matches."""
    identity: dict[str, Any] = {"engine": engine_config.model_dump(mode="json"), "batcher": batcher.model_dump(mode="json"),
                                "concurrency": concurrency, "roots": sorted(urls.normalize(r) for r in storage_roots)}
    if judge_endpoints:
        identity["judge_endpoints"] = sorted(judge_endpoints)
    blob = orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(blob).hexdigest()[:16]


def _redact(url: str) -> str:
    return _USERINFO.sub("://***@", url)


def _error(status: int, message: str, *, retryable: bool) -> web.Response:
    return web.json_response({"error": message, "retryable": retryable}, status=status)


def create_app(runtime: WorkerRuntime, settings: WorkerSettings, *, config_id: str = "") -> web.Application:
    """The aiohttp application around a runtime (tests call this directly)."""
    roots = [urls.normalize(r) for r in settings.storage_roots]
    token = settings.token

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token is not None and request.path != "/health":  # probes need no secret
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                log.warning("refused %s %s from %s: missing or wrong bearer token", request.method, request.path, request.remote)
                return _error(401, "missing or wrong bearer token", retryable=False)
        return await handler(request)

    async def post_task(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"request body over {settings.max_body_bytes} bytes", retryable=False)
        try:
            spec = TaskSpec.model_validate_json(body)
        except ValidationError as exc:
            return _error(400, f"bad task spec: {exc}", retryable=False)
        outside = [u for u in spec.urls() if not is_under(u, roots)]
        if outside:
            log.warning("refused task %s: %s outside the storage roots", spec.task_id, ", ".join(_redact(u) for u in outside))
            return _error(403, f"task {spec.task_id}: {len(outside)} URL(s) outside this worker's storage roots", retryable=False)
        if (rule := foreign_rule(spec, settings.rule_modules)) is not None:
            log.warning("refused task %s: rule judge %r is not allowed on this worker", spec.task_id, rule)
            return _error(403, f"task {spec.task_id}: rule judge {rule!r} is neither a built-in rule nor in a module "
                               f"this worker allows (--allow-rule-module)", retryable=False)
        try:
            result = await runtime.run(spec)
        except EngineDeadError as exc:  # the worker's fault, never the shard's: another worker retries it
            return _error(503, f"task {spec.task_id}: worker {runtime.name} engine dead: {exc}", retryable=True)
        except Refused as exc:
            return _error(exc.status, str(exc), retryable=exc.retryable)
        except TaskConflict as exc:  # the judge pool holds one of its waves' ids with another spec
            return _error(409, str(exc), retryable=False)
        except (TaskInputError, MalformedRecordError, CorruptShardError, FileNotFoundError) as exc:
            return _error(422, f"task {spec.task_id}: {type(exc).__name__}: {exc}", retryable=False)
        except OSError as exc:
            if is_machine_error(exc):  # disk full, quota, read-only: no worker sharing it does better
                return _error(507, f"task {spec.task_id}: {type(exc).__name__}: {exc}", retryable=False)
            return _error(500, f"task {spec.task_id}: {type(exc).__name__}: {exc}", retryable=True)
        except Exception as exc:  # noqa: BLE001 - reported to the client, which retries elsewhere
            return _error(500, f"task {spec.task_id}: {type(exc).__name__}: {exc}", retryable=True)
        return web.Response(body=result.model_dump_json(), content_type="application/json")

    async def cancel_task(request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            task_id = body["task_id"] if isinstance(body, dict) else None
        except (orjson.JSONDecodeError, KeyError):
            task_id = None
        if not isinstance(task_id, str) or not task_id:
            return _error(400, 'expected {"task_id": "..."}', retryable=False)
        # shielded: the client going away must not leave the cancel half done
        cancelled = await asyncio.shield(runtime.cancel(task_id))
        return web.json_response({"task_id": task_id, "cancelled": cancelled})

    async def health(request: web.Request) -> web.Response:
        status = "unhealthy" if runtime.engine_dead else "draining" if runtime.draining else "ok"
        body = {"status": status, "worker": runtime.name, "pid": os.getpid(), "config_hash": config_id,
                "engine_loads": runtime.host.loads, "tasks_running": len(runtime.running),
                **({"engine_dead": runtime.engine_dead} if runtime.engine_dead else {})}
        return web.json_response(body, status=200 if status == "ok" else 503)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**runtime.stats(), "config_hash": config_id})

    registry = worker_registry(runtime.stats)  # this app's own (several workers may share a process)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[auth], client_max_size=settings.max_body_bytes)
    app.add_routes([web.post("/tasks", post_task), web.post("/tasks/cancel", cancel_task), web.get("/health", health), web.get("/stats", stats), web.get("/metrics", metrics)])
    return app


def foreign_rule(spec: TaskSpec, allowed_modules: list[str]) -> str | None:
    """The task's rule-judge import path when the worker does not allow its module, else None."""
    judge = spec.judge
    if judge is None or judge.kind != "rule" or not judge.callable or judge.callable in BUILTIN_RULES:
        return None
    return None if judge.callable.partition(":")[0] in allowed_modules else judge.callable


def check_security(settings: WorkerSettings) -> None:
    """Refuse to serve off loopback without a token (raises ``PermissionError``)."""
    if not is_loopback(settings.host) and not settings.token:
        raise PermissionError(
            f"refusing to bind {settings.host}: off loopback a bearer token is required "
            f"(set ${TOKEN_ENV} or pass --token-file, e.g. a mounted Kubernetes secret)"
        )


async def serve(
    engine_config: EngineConfig,
    settings: WorkerSettings,
    *,
    batcher: BatcherOptions | None = None,
    storage_profiles: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Run one worker until SIGTERM/SIGINT or ``idle_ttl_s`` of idleness."""
    check_security(settings)
    if settings.gil_switch_interval_s is not None:
        sys.setswitchinterval(settings.gil_switch_interval_s)
    batcher = batcher or BatcherOptions()
    config_id = config_hash(engine_config, batcher, settings.concurrency, settings.storage_roots, settings.judge_endpoints)
    host = EngineHost(engine_config, batcher)
    await host.start()
    log.info("engine %s loaded in %.2fs", host.engine.name if host.engine else "?", host.load_time_s)
    judge_pool = judge_pool_client(settings) if settings.judge_endpoints else None
    runtime = WorkerRuntime(host, concurrency=settings.concurrency, storage_profiles=storage_profiles,
                            checkpoint_interval_s=settings.checkpoint_interval_s, judge_runner=judge_pool)
    # handler_cancellation: a client that closes its connection (its run was cancelled) cancels
    # the handler, and with it the task when no other request waits on it (WorkerRuntime._join)
    runner = web.AppRunner(create_app(runtime, settings, config_id=config_id), access_log=None,
                           shutdown_timeout=settings.grace_s + 5, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = runner.addresses[0][1]
    runtime.name = f"{settings.host if is_loopback(settings.host) else socket.gethostname()}:{port}"
    stop = asyncio.Event()
    reason = {"why": ""}

    def request_stop(why: str) -> None:
        reason["why"] = reason["why"] or why
        stop.set()

    # A dead engine cannot come back in this process: stop (grace 0 below: nothing can
    # finish) and exit non-zero, so the launcher replaces the worker.
    runtime.on_engine_dead = lambda why: request_stop(f"engine dead: {why}")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, sig.name)
    watcher = asyncio.create_task(_idle_watch(runtime, settings.idle_ttl_s, request_stop)) if settings.idle_ttl_s else None
    if settings.ready_file:
        _write_ready(settings.ready_file, {"pid": os.getpid(), "host": settings.host, "port": port, "config_hash": config_id})
    log.info("worker %s serving (pid %d, concurrency %d, roots %s)", runtime.name, os.getpid(), settings.concurrency, settings.storage_roots)
    try:
        await stop.wait()
    finally:
        log.info("worker %s stopping (%s): draining %d running task(s), grace %.0fs",
                 runtime.name, reason["why"] or "exit", len(runtime.running), settings.grace_s)
        if watcher is not None:
            watcher.cancel()
        abandoned = await runtime.drain(0.0 if runtime.engine_dead else settings.grace_s)
        if abandoned:
            log.warning("abandoned %d task(s) (the dispatcher retries them): %s", len(abandoned), ", ".join(abandoned))
        await runner.cleanup()
        if judge_pool is not None:
            await judge_pool.close()
        await host.close()
    if runtime.engine_dead:
        raise SystemExit(f"worker {runtime.name}: engine dead ({runtime.engine_dead})")


def judge_pool_client(settings: WorkerSettings) -> PoolClient:
    """The client this worker's retry tasks send their judge waves through. A busy judge pool
    (429: its slots taken by other workers' waves) is waited for, however long, never failed:
    its slots are sized apart from the infer pool's, and a wave refused for a while is no
    fault of its shard's (docs/pool.md "The judge's own pool")."""
    return PoolClient(settings.judge_endpoints, concurrency=settings.judge_concurrency, token=settings.judge_token,
                      timeout_s=settings.judge_timeout_s, max_refusals=None)


async def _idle_watch(runtime: WorkerRuntime, ttl_s: float, request_stop: Any) -> None:
    while True:
        await asyncio.sleep(min(1.0, ttl_s / 4))
        if runtime.idle_s >= ttl_s:
            request_stop(f"idle for {ttl_s:g}s")
            return


def _write_ready(path: str, info: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    Path(tmp).write_bytes(orjson.dumps(info))
    os.replace(tmp, path)


def run_worker(
    engine_config_file: str,
    settings: WorkerSettings,
    *,
    batcher: BatcherOptions | None = None,
    storage_profiles_file: str | None = None,
) -> None:
    """Blocking entry point for the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = EngineConfig.model_validate(load_config_file(engine_config_file))
    profiles = load_config_file(storage_profiles_file) if storage_profiles_file else None
    t0 = time.perf_counter()
    asyncio.run(serve(engine_config, settings, batcher=batcher, storage_profiles=profiles))
    log.info("worker exited after %.1fs", time.perf_counter() - t0)
