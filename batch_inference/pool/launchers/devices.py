"""The devices each replica of a local pool computes on.

A local pool runs its replicas side by side on one host. Left alone, every replica's
engine takes the same devices: vLLM and torch open the first GPU in every process (a
second vLLM replica then fails for memory, or two share one GPU while the others idle),
and vLLM's CPU build pins its compute threads to the same cores in every process (its
``auto`` binding assumes one engine a NUMA node: two replicas on a 2-core host both
computed on core 0). So each replica gets its own share, in its environment:

- GPUs (``vllm`` or ``transformers``, ``device`` not ``cpu``, GPUs visible):
  ``CUDA_VISIBLE_DEVICES`` of ``tensor_parallel_size`` consecutive GPUs of the visible
  ones; more replicas than GPU groups share them round-robin (warned: each engine's
  ``gpu_memory_utilization`` must leave room for the other's);
- vLLM on CPU, two replicas or more: ``VLLM_CPU_OMP_THREADS_BIND`` of a disjoint run of
  the cores this process may use (one list a tensor-parallel rank, ``|``-separated).

What the environment already says is kept: ``CUDA_VISIBLE_DEVICES`` is the GPUs to share
out (so ``CUDA_VISIBLE_DEVICES=2,3 batch-inference pool up ...`` keeps a pool off the
others), and a ``VLLM_CPU_OMP_THREADS_BIND`` set by hand is left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

from batch_inference.engines import EngineConfig

log = logging.getLogger(__name__)

GPU_ENV = "CUDA_VISIBLE_DEVICES"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class DevicesError(ValueError):
    """A replica needs more devices than the host shows."""


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs a process started here would see: ``CUDA_VISIBLE_DEVICES`` when set (its
    entries, indices or UUIDs), else ``nvidia-smi -L``'s (none without the driver)."""
    if GPU_ENV in environ:
        return [d.strip() for d in environ[GPU_ENV].split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _spans(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` consecutive runs of sizes differing by at most one."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _id_list(cores: Sequence[int]) -> str:
    return ",".join(map(str, cores))


def replica_environments(engine: EngineConfig, replicas: int, *, environ: Mapping[str, str] = os.environ,
                         gpus: Sequence[str] | None = None, cores: Sequence[int] | None = None) -> list[dict[str, str]]:
    """What each of ``replicas`` replicas adds to its environment (see the module doc);
    ``gpus`` and ``cores`` default to this host's."""
    if engine.kind == "simulated":
        return [{} for _ in range(replicas)]
    tp = engine.vllm.tensor_parallel_size if engine.kind == "vllm" else 1
    gpus = visible_gpus(environ) if gpus is None else list(gpus)
    if engine.device != "cpu" and gpus:
        if tp > len(gpus):
            raise DevicesError(f"a replica of {engine.model} needs {tp} GPUs (tensor_parallel_size); {len(gpus)} visible "
                               f"({GPU_ENV}={','.join(gpus)})")
        groups = len(gpus) // tp
        if replicas > groups:
            log.warning("local pool: %d replicas on %d GPU group(s) of %d: replicas share GPUs (each engine's "
                        "gpu_memory_utilization must leave room for the others)", replicas, groups, tp)
        return [{GPU_ENV: ",".join(gpus[(i % groups) * tp:(i % groups + 1) * tp])} for i in range(replicas)]
    if engine.kind != "vllm" or replicas < 2 or CPU_BIND_ENV in environ:
        return [{} for _ in range(replicas)]
    cores = allowed_cores() if cores is None else sorted(cores)
    shares = _spans(cores, min(replicas, len(cores)))
    if any(len(share) < tp for share in shares):
        log.warning("local pool: %d replicas of %d CPU ranks each on %d cores: left to vLLM's own binding", replicas, tp, len(cores))
        return [{} for _ in range(replicas)]
    binds = ["|".join(_id_list(rank) for rank in _spans(share, tp)) for share in shares]
    if replicas > len(cores):
        log.warning("local pool: %d vLLM-CPU replicas on %d cores: replicas share cores", replicas, len(cores))
    return [{CPU_BIND_ENV: binds[i % len(binds)]} for i in range(replicas)]
