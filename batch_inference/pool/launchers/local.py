"""``LocalLauncher``: a pool of worker processes on this machine, reused across runs.

``up()`` starts ``replicas`` workers on 127.0.0.1 (each on a free port), waits until
they answer ``/health``, and records them in a state file (pids, ports, config hash).
A later ``up()`` with the same configuration -- from the same process, a later run or
a later Dagster run -- finds them healthy and reuses them, so the model stays hot; dead
workers are restarted, workers of another configuration are replaced, and ``replaced``
(logged as a warning) names what differed. A run's launcher (``adopt=True``: a spec's
``pool: {launcher: local}``) attaches to the pool already up under its name (``batch-inference
pool up``) when it *fits*: the same engine, batcher and judge endpoints, storage roots that
hold the run's; it keeps that pool's slots, roots and replicas (more than the spec asks
stay). Workers stop
themselves after ``idle_ttl_s`` idle (replicas above ``min_replicas`` after
``scaledown_ttl_s``), the reference's ReusePolicy; ``down()`` stops them by PID.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from batch_inference.engines import EngineConfig
from batch_inference.pool.client import PoolClient
from batch_inference.pool.engine_host import BatcherOptions
from batch_inference.pool.launchers.devices import replica_environments
from batch_inference.pool.worker import config_hash
from batch_inference.storage import urls

log = logging.getLogger(__name__)

STATE_DIR_ENV = "BATCH_INFERENCE_POOL_DIR"


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or Path.home() / ".cache" / "batch_inference" / "pools")


@dataclass
class WorkerRecord:
    """One worker as the state file remembers it."""

    replica: int
    pid: int
    port: int
    idle_ttl_s: float | None
    log: str
    started_at: float = field(default_factory=time.time)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class WorkerStatus:
    replica: int
    pid: int
    endpoint: str
    alive: bool
    healthy: bool
    detail: dict[str, Any] = field(default_factory=dict)


class LocalLauncher:
    """Start/reuse/stop a pool of local worker processes (see module doc)."""

    def __init__(
        self,
        engine_config: EngineConfig | dict[str, Any] | None,
        *,
        replicas: int = 2,
        concurrency: int = 10,
        storage_roots: list[str] | None = None,
        batcher: BatcherOptions | dict[str, Any] | None = None,
        idle_ttl_s: float | None = 600.0,
        scaledown_ttl_s: float | None = None,
        min_replicas: int | None = None,
        name: str = "default",
        state_dir: str | Path | None = None,
        storage_profiles_file: str | None = None,
        grace_s: float = 30.0,
        start_timeout_s: float = 180.0,
        python: str = sys.executable,
        rule_modules: list[str] | None = None,
        judge_endpoints: list[str] | None = None,
        adopt: bool = False,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        # None: a handle for status()/down() of an existing pool only (up() needs a config)
        self.engine_config = engine_config if isinstance(engine_config, EngineConfig) or engine_config is None else EngineConfig.model_validate(engine_config)
        self.batcher = batcher if isinstance(batcher, BatcherOptions) else BatcherOptions.model_validate(batcher or {})
        self.replicas = replicas
        self.concurrency = concurrency
        self.storage_roots = [os.path.abspath(r) if "://" not in r else r for r in (storage_roots or [os.getcwd()])]
        self.idle_ttl_s = idle_ttl_s
        self.scaledown_ttl_s = scaledown_ttl_s
        self.min_replicas = replicas if min_replicas is None else min_replicas
        self.name = name
        self.dir = Path(state_dir or default_state_dir()) / name
        self.storage_profiles_file = storage_profiles_file
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.python = python
        self.rule_modules = list(rule_modules or [])
        # the judge's own pool, where the workers' retry tasks judge (part of their identity)
        self.judge_endpoints = list(judge_endpoints or [])
        self.config_hash = (config_hash(self.engine_config, self.batcher, concurrency, self.storage_roots, self.judge_endpoints)
                            if self.engine_config else "")
        self._children: list[subprocess.Popen[bytes]] = []  # reaped as they exit (no zombies)
        self.adopt = adopt
        self.replaced: str | None = None  # why up() replaced running workers, when it did

    # -- state ------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.dir / "pool.json"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One launcher at a time per pool (two Dagster runs may call up() together)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "pool.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"workers": []}

    def _identity(self) -> dict[str, Any]:
        """What ``config_hash`` is made of, as the state file records it (to say what differs)."""
        assert self.engine_config is not None
        return {"engine": self.engine_config.model_dump(mode="json"), "batcher": self.batcher.model_dump(mode="json"),
                "concurrency": self.concurrency, "storage_roots": self.storage_roots, "judge_endpoints": self.judge_endpoints}

    def _write_state(self, workers: list[WorkerRecord]) -> None:
        state = {"name": self.name, "config_hash": self.config_hash, **(self._identity() if self.engine_config else {}), "workers": [asdict(w) for w in workers]}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.state_file)

    def _records(self) -> list[WorkerRecord]:
        return [WorkerRecord(**w) for w in self._read_state().get("workers", [])]

    # -- lifecycle --------------------------------------------------------------------

    def _reap(self) -> None:
        self._children = [p for p in self._children if p.poll() is None]

    def up(self) -> list[str]:
        """Ensure ``replicas`` healthy workers of this configuration; returns their endpoints."""
        if self.engine_config is None:
            raise ValueError(f"pool {self.name}: up() needs an engine config")
        self._reap()
        self.replaced = None
        with self._locked():
            state = self._read_state()
            if self.adopt and state.get("workers") and state.get("config_hash") != self.config_hash:
                self._attach(state)
            kept: dict[int, WorkerRecord] = {}
            replaced: list[int] = []
            for rec in self._records():
                health = _health(rec.endpoint)
                if health is None and _is_worker(rec.pid):
                    health = _health(rec.endpoint, timeout_s=10.0)  # alive but slow (busy machine): ask once more
                same = bool(health and health.get("pid") == rec.pid and health.get("config_hash") == self.config_hash)
                if rec.replica < self.replicas and same and health and health.get("status") == "ok":
                    kept[rec.replica] = rec
                else:
                    other = bool(health and health.get("config_hash") != self.config_hash)
                    why = "another configuration" if other else "not healthy"
                    log.info("pool %s: replacing worker %d (pid %d, %s)", self.name, rec.replica, rec.pid, why)
                    if other:
                        replaced.append(rec.pid)
                    _stop_pid(rec.pid, self.grace_s)
            if replaced:
                self.replaced = (f"replaced {len(replaced)} running worker(s) (pid {', '.join(map(str, replaced))}) started "
                                 f"with another configuration: {'; '.join(self._differences(state)) or 'unknown differences'}")
                log.warning("pool %s: %s", self.name, self.replaced)
            devices = replica_environments(self.engine_config, self.replicas)  # refused before any worker starts
            started = {i: self._spawn(i, devices[i]) for i in range(self.replicas) if i not in kept}
            for i, (proc, ready) in started.items():
                kept[i] = self._await_ready(i, proc, ready)
            workers = [kept[i] for i in sorted(kept)]
            self._write_state(workers)
            if started:
                log.info("pool %s: started %d worker(s), reused %d", self.name, len(started), len(workers) - len(started))
            return [w.endpoint for w in workers]

    heal = up  # restarting dead workers on demand is just up() again

    def _differences(self, state: dict[str, Any]) -> list[str]:
        """What the recorded pool's configuration has that this one does not, key by key."""
        if "engine" not in state:
            return ["the running pool's state file predates recording its configuration"]
        mine = self._identity()
        out: list[str] = []
        for key in ("engine", "batcher"):
            out += [f"{key}.{k}: {a!r} -> {b!r}" for k, a, b in _changed(state.get(key) or {}, mine[key])]
        for key in ("concurrency", "storage_roots", "judge_endpoints"):
            theirs, ours = state.get(key), mine[key]
            if key != "concurrency":
                theirs, ours = sorted(theirs or []), sorted(ours)
            if theirs != ours:
                out.append(f"{key}: {theirs!r} -> {ours!r}")
        return out

    def _misfit(self, state: dict[str, Any]) -> list[str]:
        """Why the running pool cannot serve this run (empty: it can): another engine,
        batcher or judge pool, or storage roots that do not hold this run's."""
        if "engine" not in state:
            return self._differences(state)
        out = [d for d in self._differences(state) if d.startswith(("engine.", "batcher.", "judge_endpoints:"))]
        outside = [r for r in self.storage_roots if not urls.is_under(r, state.get("storage_roots") or [])]
        if outside:
            out.append(f"storage_roots: {sorted(state.get('storage_roots') or [])!r} do not hold {outside!r}")
        return out

    def _attach(self, state: dict[str, Any]) -> None:
        """Take the running pool's configuration when it fits this run (``adopt``), so its
        workers are reused as they are; else leave ours (``up()`` replaces them, saying why)."""
        if self._misfit(state):
            return
        self.concurrency = int(state["concurrency"])
        self.storage_roots = list(state["storage_roots"])
        self.replicas = max(self.replicas, len(state.get("workers") or []))
        self.config_hash = str(state["config_hash"])
        log.info("pool %s: attaching to the running pool (%d worker(s), %d slots each, roots %s)",
                 self.name, len(state["workers"]), self.concurrency, ", ".join(self.storage_roots))

    def endpoints(self) -> list[str]:
        """Endpoints of the recorded workers that answer ``/health`` now."""
        return [s.endpoint for s in self.status() if s.healthy]

    def status(self) -> list[WorkerStatus]:
        self._reap()
        out = []
        for rec in self._records():
            health = _health(rec.endpoint)
            alive = psutil.pid_exists(rec.pid)
            healthy = bool(health and health.get("pid") == rec.pid and health.get("status") == "ok")
            out.append(WorkerStatus(rec.replica, rec.pid, rec.endpoint, alive, healthy, health or {}))
        return out

    def down(self) -> int:
        """Stop every recorded worker (SIGTERM, then SIGKILL after the grace period); returns how many."""
        with self._locked():
            records = self._records()
            for rec in records:
                _stop_pid(rec.pid, self.grace_s)
            self._write_state([])
        self._reap()
        return len(records)

    def client(self, **kwargs: Any) -> PoolClient:
        """A PoolClient over this pool that restarts dead workers on demand."""
        import asyncio

        async def refresh() -> list[str]:
            return await asyncio.to_thread(self.up)

        endpoints = self.up()  # first: attaching to a running pool takes its slots
        kwargs.setdefault("concurrency", self.concurrency)
        return PoolClient(endpoints, refresh=refresh, **kwargs)

    # -- processes ------------------------------------------------------------------------

    def _spawn(self, replica: int, devices: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        """Start worker ``replica`` with ``devices`` (its share of the host: ``launchers.devices``) in its environment."""
        self.dir.mkdir(parents=True, exist_ok=True)
        engine_file = self.dir / "engine.json"
        engine_file.write_text(self.engine_config.model_dump_json())  # type: ignore[union-attr]
        ready = self.dir / f"worker-{replica}.ready"
        ready.unlink(missing_ok=True)
        ttl = self.idle_ttl_s if replica < self.min_replicas else (self.scaledown_ttl_s or self.idle_ttl_s)
        b = self.batcher
        cmd = [self.python, "-m", "batch_inference.cli.pool_cmds", "--engine-config", str(engine_file),
               "--host", "127.0.0.1", "--port", "0", "--concurrency", str(self.concurrency),
               "--ready-file", str(ready), "--grace-s", str(self.grace_s),
               "--target-batch-tokens", str(b.target_batch_tokens), "--max-batch-size", str(b.max_batch_size),
               "--batch-timeout-s", str(b.batch_timeout_s), "--prefetch-batches", str(b.prefetch_batches),
               "--max-queue-size", str(b.max_queue_size)]
        for root in self.storage_roots:
            cmd += ["--storage-root", root]
        for module in self.rule_modules:
            cmd += ["--allow-rule-module", module]
        for endpoint in self.judge_endpoints:
            cmd += ["--judge-endpoint", endpoint]
        if ttl:
            cmd += ["--idle-ttl-s", str(ttl)]
        if self.storage_profiles_file:
            cmd += ["--storage-options", self.storage_profiles_file]
        log_path = self.dir / f"worker-{replica}.log"
        if devices:
            log.info("pool %s: worker %d on %s", self.name, replica, " ".join(f"{k}={v}" for k, v in devices.items()))
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **devices},
                                    start_new_session=True)  # outlives this process: the pool is reused
        self._children.append(proc)
        return proc, ready

    def _await_ready(self, replica: int, proc: subprocess.Popen[bytes], ready: Path) -> WorkerRecord:
        deadline = time.monotonic() + self.start_timeout_s
        log_path = self.dir / f"worker-{replica}.log"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                raise RuntimeError(f"worker {replica} exited with code {proc.returncode} before it was ready:\n{tail}")
            if ready.exists():
                info = json.loads(ready.read_text())
                rec = WorkerRecord(replica, proc.pid, int(info["port"]), self.idle_ttl_s, str(log_path))
                if _health(rec.endpoint):
                    return rec
            time.sleep(0.05)
        _stop_pid(proc.pid, 0)
        raise TimeoutError(f"worker {replica} not healthy within {self.start_timeout_s:.0f}s (log: {log_path})")


def _health(endpoint: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 while draining still identifies the worker
        try:
            return json.loads(exc.read())
        except (ValueError, OSError):
            return None
    except (OSError, ValueError):
        return None


def _is_worker(pid: int) -> bool:
    """Guard against PID reuse: only ever signal a process that is one of our workers."""
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "batch_inference.cli.pool_cmds" in cmdline


def _stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM (the worker drains), then SIGKILL after ``grace_s`` + a margin."""
    if not _is_worker(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        psutil.Process(pid).wait(timeout=grace_s + 5)
    except psutil.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass


def _changed(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, a's value, b's value) for every leaf that differs between two dicts."""
    out: list[tuple[str, Any, Any]] = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _changed(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append((f"{prefix}{k}", x, y))
    return out
