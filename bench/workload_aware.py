"""Workload-aware order against raw vLLM: prefix-heavy batches with a KV cache that cannot hold them.

Five workload shapes, built in code, each a few hundred records on the tiny model:

- ``docs_questions``: documents asked several questions each, interleaved (every document
  once per question);
- ``few_shot``: a long few-shot block per task type, the tasks of all types interleaved;
- ``multi_turn``: conversations (chat, the model's chat template) whose every turn is a
  request extending the one before, interleaved turn by turn;
- ``repeats``: exact repeats at greedy sampling, interleaved;
- ``control``: distinct prompts, nothing shared;
- ``short_questions`` / ``mid_questions``: short (~170-token) / mid (~700-token) documents
  asked 6 questions each, 20% of the records exact repeats of others, in random order;
  ``short_repeats``: distinct prompts of 100-700 tokens, 4 exact copies each, interleaved
  (issue 41's short requests: run them with ``--output`` 1-16 and a few thousand ``--records``);
- ``preamble_docs``: a ~2.4 KB instruction preamble every record has (longer than a prefix
  family's name was allowed to be: 512 tokens of 4 characters), then one of 30 short
  documents and a question about it, interleaved. It runs on a pool of **2 local workers**
  instead (``affinity``: ``pool.affinity`` on, the default; ``no_affinity``: off), each
  measurement on a pool started for it (a worker's prefix cache cannot be emptied from
  outside), to check that prefix affinity never costs load balance: a preamble every
  record shares must not name one family and pile the shards on one worker.

vLLM-CPU's KV cache is limited with ``num_gpu_blocks_override`` (``--blocks``, default 100
blocks of 128 tokens) so the distinct prefixes do not fit, as on a GPU at scale. For each
shape, back to back and repeated:

- ``raw``: one ``LLM.generate`` of the same prompts, in input order, same cache size
  (tokenising them included, as ``LLM.generate`` of text does it);
- ``limit``: the same raw engine (same ``LLM`` object, same cache) given each distinct request
  once, in prefix order, in one ``LLM.generate`` call: every distinct prefix computed once and
  every distinct request once (what no order can beat; ``bench/_limit.py``). The pipeline's
  records/s is reported against it over the infer phase alone and with the shard step (where
  the layout pass runs) added;
- ``on``: the pipeline's infer phase (one round, ``InProcessPool``, the streaming engine),
  ``layout.prefix`` on (the default);
- ``off``: the same with ``layout.prefix: false``.

Every in-process measurement also records the engine's own scheduler figures at each update
(``_limit.StepCounters``: running and waiting requests, preemptions, prefix-cache hits) and,
for the pipeline, the requests its ``StreamGate`` had in flight: the report compares the
limit's steps with the pipeline's (issue 32 item 2).

``llm.reset_prefix_cache()`` empties each engine's cache before every measurement. Every
record asks for exactly ``--output`` tokens (``max_tokens = min_tokens``) at temperature 0,
so every path decodes the same tokens. With ``--stop`` (repeatable) every path asks for at
most ``--output`` tokens and those stop strings instead (vLLM then detokenises every step
to find them, and a record that meets one ends there: issue 32 item 4); raw, limit and
pipeline still decode the same greedy tokens, and the report says so per measurement
(output tokens, records that stopped, a digest of the texts in record order). Pipeline figures are the ledger's infer phase
(records_in and tokens_out over its wall: reading, rendering, dispatch and writing
included; the shard step, where the layout is computed, reported apart).

    env=$(bash .ci/vllm_cpu_env.sh)
    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 $env/bin/python bench/workload_aware.py
    .venv/bin/python bench/workload_aware.py --records 120 --repeats 1   # re-runs itself in that venv
    .venv/bin/python bench/workload_aware.py --shapes control --stop Through --repeats 3 --report bench/reports/workload_aware_stops.md

Writes bench/reports/workload_aware.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _raw_vllm
from _limit import StepCounters, against_limit, count_engine_steps, count_llm_steps, measure_limit
from _raw_vllm import load, serve, settle
from engine_ceiling import CpuMeter

REPORTS = Path(__file__).resolve().parent / "reports"
VOCAB = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box near rivers "
         "mountains and old cities under pale sky bright cold warm river stone field house light").split()
SHAPES = ("docs_questions", "few_shot", "multi_turn", "repeats", "control", "preamble_docs")
# short requests (issue 41): prompts of 100-700 tokens, run with --output 1-16 and a few thousand --records
SHORT_SHAPES = ("short_questions", "mid_questions", "short_repeats")
POOL_SHAPES = ("preamble_docs",)  # measured on 2 local workers, affinity on and off
CPU_BLOCK = 128


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def build(shape: str, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """About ``n`` records of one shape, in the order a user would write them (interleaved)."""
    recs: list[dict[str, Any]] = []
    if shape == "docs_questions":  # ~1,300-token documents, 8 questions each, every document once per question
        questions = 8
        docs = [f"Document {d}: {words(rng, 420)}" for d in range(max(1, n // questions))]
        asks = [f"Question {q}: {words(rng, 5)}?" for q in range(questions)]
        recs = [{"prompt": f"{doc}\n\n{ask}\nAnswer:"} for ask in asks for doc in docs]
    elif shape == "few_shot":  # a ~1,150-token few-shot block per task type, 16 types interleaved
        types = 16
        blocks = [f"Task type {t}. Worked examples follow.\n{words(rng, 380)}\n" for t in range(types)]
        recs = [{"prompt": f"{blocks[t]}Input {i}: {words(rng, 20)}\nOutput:"} for i in range(max(1, n // types)) for t in range(types)]
    elif shape == "multi_turn":  # conversations of 8 turns, each turn's request holds every turn before it
        turns = 8
        convs = []
        for c in range(max(1, n // turns)):
            msgs = [{"role": "system", "content": f"Conversation {c}. You are a helpful assistant."}]
            for _ in range(turns):
                msgs += [{"role": "user", "content": words(rng, 25)}, {"role": "assistant", "content": words(rng, 25)}]
            convs.append(msgs)
        recs = [{"messages": conv[:2 * t + 2]} for t in range(turns) for conv in convs]  # ends with a user turn
    elif shape == "repeats":  # 4 exact copies of each prompt, interleaved
        copies = 4
        distinct = [f"Request {i}: {words(rng, 300)}\nAnswer:" for i in range(max(1, n // copies))]
        recs = [{"prompt": p} for _ in range(copies) for p in distinct]
    elif shape == "control":  # nothing shared: every prompt its own from its first token
        recs = [{"prompt": f"{rng.randrange(10**9)} {words(rng, 300)}\nAnswer:"} for _ in range(n)]
    elif shape == "preamble_docs":  # one ~2.4 KB preamble, then 30 short documents, 8 questions each, interleaved
        questions = 8
        preamble = f"Instructions. {words(random.Random('preamble'), 420)}\n\n"
        docs = [f"Document {d}: {words(rng, 90)}" for d in range(max(1, n // questions))]
        asks = [f"Question {q}: {words(rng, 5)}?" for q in range(questions)]
        recs = [{"prompt": f"{preamble}{doc}\n\n{ask}\nAnswer:"} for ask in asks for doc in docs]
    elif shape in ("short_questions", "mid_questions"):  # short (~170) / mid (~700-token) documents x 6 questions, 20% exact repeats
        questions, size = 6, 45 if shape == "short_questions" else 220
        docs = [f"Document {d}: {words(rng, size)}" for d in range(max(1, round(n / questions / 1.2)))]
        asks = [f"Question {q}: {words(rng, 5)}?" for q in range(questions)]
        recs = [{"prompt": f"{doc}\n\n{ask}\nAnswer:"} for ask in asks for doc in docs]
        recs += [dict(r) for r in rng.sample(recs, n - len(recs))] if n > len(recs) else []  # the repeats, interleaved below
        rng.shuffle(recs)
    elif shape == "short_repeats":  # distinct prompts of 100-700 tokens, 4 exact copies each, interleaved
        copies = 4
        distinct = [f"Request {i}: {words(rng, rng.randint(30, 220))}\nAnswer:" for i in range(max(1, n // copies))]
        recs = [{"prompt": p} for _ in range(copies) for p in distinct]
    else:
        raise ValueError(shape)
    return [{"id": f"r{i:06d}", **r} for i, r in enumerate(recs)]


def engine_config(model: str, blocks: int) -> dict[str, Any]:
    return {"kind": "vllm", "model": model, "dtype": "float32", "max_model_len": 2048, "device": "cpu",
            "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "num_gpu_blocks_override": blocks}}}


def sampling_kwargs(output: int, stop: list[str] | None) -> dict[str, Any]:
    """The length rule every path applies: exactly ``output`` tokens, or with stop strings at
    most ``output`` (a stop string cannot end a record before ``min_tokens``)."""
    return {"max_tokens": output, "stop": list(stop)} if stop else {"max_tokens": output, "min_tokens": output}


def texts_digest(texts: list[str | None]) -> str:
    """The completions in record order, as one short digest (raw and pipeline must agree)."""
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- raw


def encoded(tokenizer: Any, records: list[dict[str, Any]]) -> list[list[int]]:
    """The token ids the pipeline's engine computes for each record (text and chat alike)."""
    from batch_inference.engines.chat import encode_prompts
    from batch_inference.prompting import InferConfig, RequestBuilder

    builder = RequestBuilder(InferConfig())
    return encode_prompts(tokenizer, [builder.prompt(r) for r in records])


def raw_server(model: str, blocks: int) -> None:
    """The raw engine in a process of its own (one vLLM engine a process), fed job lines."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    from batch_inference.engines import EngineConfig
    from batch_inference.engines.vllm_engine import engine_kwargs

    cfg = EngineConfig.model_validate(engine_config(model, blocks))
    llm = LLM(**engine_kwargs(cfg), disable_log_stats=False)  # its scheduler's figures, per step (the pipeline's engine keeps them too)
    tok = llm.get_tokenizer()
    counters = count_llm_steps(llm)

    def handle(job: dict[str, Any]) -> dict[str, Any]:
        counters.reset()
        out = run(job)
        return {**out, "engine": counters.summary()}

    def run(job: dict[str, Any]) -> dict[str, Any]:
        stop = job.get("stop")
        if job["order"] == "limit":  # each distinct request once, in prefix order, one generate call
            return measure_limit(llm, lambda recs: encoded(tok, recs), job["records"], job["output"], stop=stop)
        sampling = VllmSamplingParams(**sampling_kwargs(job["output"], stop), temperature=0.0)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()  # tokenising counts, as it does in LLM.generate of text and in the pipeline's phase
        ids = encoded(tok, job["records"])
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(x)) for x in ids], sampling_params=sampling, use_tqdm=False)
        secs = time.perf_counter() - t0
        return {"requests": len(ids), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "prompt_tokens": sum(map(len, ids)), "seconds": secs,
                "stopped": sum(o.outputs[0].finish_reason == "stop" for o in outs),
                "digest": texts_digest([o.outputs[0].text for o in outs])}

    serve(handle)


class RawProcess:
    """The raw engine's helper process (``_raw_vllm.RawProcess``)."""

    def __init__(self, model: str, blocks: int) -> None:
        self.helper = _raw_vllm.RawProcess(__file__, ["--model", model, "--blocks", str(blocks)])

    def run(self, records: list[dict[str, Any]], order: str, output: int, stop: list[str] | None = None) -> dict[str, Any]:
        return self.helper.request({"records": records, "order": order, "output": output, "stop": stop})

    def close(self) -> None:
        self.helper.close()


# --------------------------------------------------------------------------- pipeline


def pipeline_spec(model: str, blocks: int, root: Path, run: str, data: Path, n: int, output: int, prefix: bool,
                  stop: list[str] | None = None, signature: str | None = None) -> Any:
    sampling = {"max_tokens": output, "temperature": 0.0, **({"stop": list(stop)} if stop else {})}
    return _raw_vllm.pipeline_spec(
        engine=engine_config(model, blocks), root=root, run=run, data=data, shard_records=max(1, n // 4),
        infer={"sampling": sampling},  # the record's own prompt / messages
        launcher="inprocess", layout={"prefix": prefix, **({"signature": signature} if signature else {})})


async def run_pipeline_once(spec: Any, pool: Any, counters: StepCounters) -> dict[str, Any]:
    from batch_inference.pipeline import Ledger, RunLayout, run_pipeline

    await pool.host.engine.reset_prefix_cache()
    counters.reset()
    summary = await run_pipeline(spec, runner=pool)
    engine = counters.summary()
    view = Ledger(RunLayout(spec.output, spec.run), spec.storage_options).view()
    infer = view.rounds[0].infer
    assert infer is not None and summary.conservation["ok"]
    layout = view.shard.layout
    rows = sorted(result_rows(RunLayout(spec.output, spec.run).results), key=lambda r: r["id"])
    return {"records": infer.records_in, "tokens": infer.tokens_out, "prompt_tokens": infer.tokens_in, "seconds": infer.wall_s,
            "shard_s": view.shard.wall_s, "failed": summary.failed, "engine": engine,
            "layout": layout.as_dict() if layout is not None else None,
            "stopped": sum(r.get("finish_reason") == "stop" for r in rows), "digest": texts_digest([r.get("result") for r in rows])}


def result_rows(folder: str) -> list[dict[str, Any]]:
    """Every approved row of a run (its ``results/`` parts, compressed or not)."""
    from batch_inference.storage import JsonlFile

    return [row for part in sorted(Path(folder).glob("*.jsonl*")) for row in JsonlFile(str(part)).iter_records_sync()]


def write_input(path: Path, records: list[dict[str, Any]], output: int, stop: list[str] | None = None) -> None:
    import orjson

    sampling = {k: v for k, v in sampling_kwargs(output, stop).items() if k != "stop"}  # the spec's stop strings apply
    path.write_bytes(b"".join(orjson.dumps({**r, "sampling": sampling}) + b"\n" for r in records))


async def run_on_two_workers(args: argparse.Namespace, model: str, root: Path, run: str, data: Path, records: int,
                             affinity: bool) -> dict[str, Any]:
    """The infer phase on a pool of 2 local workers started for this measurement (so each
    starts with an empty prefix cache), ``pool.affinity`` on or off; the tasks each worker ran."""
    from batch_inference.pipeline import Ledger, RunLayout, run_pipeline
    from batch_inference.pool.launchers.local import LocalLauncher

    spec = _raw_vllm.pipeline_spec(
        engine=engine_config(model, args.blocks), root=root, run=run, data=data, shard_records=max(1, records // 4),
        infer={"sampling": {"max_tokens": args.output, "temperature": 0.0}}, launcher="local", concurrency=10)
    spec = spec.model_copy(update={"pool": spec.pool.model_copy(update={"affinity": affinity, "replicas": 2})})
    launcher = LocalLauncher(spec.engine, replicas=2, concurrency=10, storage_roots=[str(root)], name=run,
                             state_dir=root / "pools", idle_ttl_s=None, grace_s=10.0, start_timeout_s=600.0)
    try:
        client = await asyncio.to_thread(launcher.client)
        async with client:
            summary = await run_pipeline(spec, runner=client)
        ledger = Ledger(RunLayout(spec.output, spec.run), spec.storage_options)
        view = ledger.view()
        infer = view.rounds[0].infer
        assert infer is not None and summary.conservation["ok"]
        step = RunLayout(spec.output, spec.run).step_name(0, "infer")
        ran = ledger.progress(step, list(range(infer.shards)))
        per_worker = sorted(Counter(str(rec["worker"]) for rec in ran.values()).values(), reverse=True)
        return {"records": infer.records_in, "tokens": infer.tokens_out, "prompt_tokens": infer.tokens_in,
                "seconds": infer.wall_s, "shards": len(ran), "per_worker": per_worker + [0] * (2 - len(per_worker)),
                "kept_moved": [client.affinity_kept, client.affinity_moved]}
    finally:
        await asyncio.to_thread(launcher.down)


async def measure(args: argparse.Namespace, model: str, root: Path) -> list[dict[str, Any]]:
    from batch_inference.pool import InProcessPool

    shapes = args.shapes.split(",")
    in_process = [x for x in shapes if x not in POOL_SHAPES]
    raw = await asyncio.to_thread(RawProcess, model, args.blocks) if in_process else None
    pool = await InProcessPool(engine_config(model, args.blocks), concurrency=10).__aenter__() if in_process else None
    counters = count_engine_steps(pool.host.engine, pool.host.gate) if pool is not None else StepCounters()
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            for shape in shapes:
                records = build(shape, args.records, random.Random(f"{shape}-{rep}"))
                data = root / f"in-{shape}-{rep}.jsonl"
                write_input(data, records, args.output, args.stop)
                row: dict[str, Any] = {"shape": shape, "repeat": rep, "records": len(records)}
                if shape in POOL_SHAPES:
                    for path in (["affinity", "no_affinity"] if rep % 2 == 0 else ["no_affinity", "affinity"]):
                        before = load()
                        res = await run_on_two_workers(args, model, root, f"{shape}-{rep}-{path}", data, len(records),
                                                       affinity=path == "affinity")
                        res.update(records_s=res["records"] / res["seconds"], load=[before, load()])
                        row[path] = res
                    row["affinity"]["vs_off"] = row["affinity"]["records_s"] / row["no_affinity"]["records_s"]
                    rows.append(row)
                    print(json.dumps({"shape": shape, "repeat": rep, **{p: round(row[p]["records_s"], 1) for p in ("affinity", "no_affinity")},
                                      "affinity/off": round(row["affinity"]["vs_off"], 3),
                                      "per_worker": {p: row[p]["per_worker"] for p in ("affinity", "no_affinity")}}), flush=True)
                    continue
                assert raw is not None and pool is not None
                paths = ["raw", "limit", "on", "off"] if rep % 2 == 0 else ["raw", "limit", "off", "on"]
                for path in paths:
                    waited = settle()
                    before, cpu = load(), CpuMeter()
                    if path in ("raw", "limit"):
                        res = await asyncio.to_thread(raw.run, records, "input" if path == "raw" else "limit", args.output, args.stop)
                        res["records"] = len(records)  # the limit answers every record (duplicates from one request)
                    else:
                        spec = pipeline_spec(model, args.blocks, root, f"{shape}-{rep}-{path}", data, len(records), args.output,
                                             prefix=path == "on", stop=args.stop, signature=args.signature)
                        res = await run_pipeline_once(spec, pool, counters)
                    decoded = res["tokens"] if args.stop else len(records) * args.output  # the limit decodes each distinct request once
                    res.update(records_s=res["records"] / res["seconds"], tok_s=decoded / res["seconds"], load=[before, load()],
                               cpu_s=cpu.stop(), settled_s=waited)
                    row[path] = res
                for path in ("on", "off", "limit"):
                    row[path]["vs_raw"] = row[path]["records_s"] / row["raw"]["records_s"]
                for path in ("on", "off"):  # records/s against the same run's limit, infer phase alone and with the shard step
                    row[path].update(against_limit(row[path], row["limit"]))
                row["raw"]["of_limit"] = row["raw"]["records_s"] / row["limit"]["records_s"]
                rows.append(row)
                row["same_output"] = all(row[p].get("digest") == row["raw"]["digest"] and row[p]["tokens"] == row["raw"]["tokens"]
                                         for p in ("on", "off"))
                print(json.dumps({"shape": shape, "repeat": rep, **{p: round(row[p]["records_s"], 1) for p in ("raw", "limit", "on", "off")},
                                  "same_output": row["same_output"], "stopped": row["raw"]["stopped"],
                                  "on/raw": round(row["on"]["vs_raw"], 3), "off/raw": round(row["off"]["vs_raw"], 3),
                                  "on/limit": round(row["on"]["of_limit"], 3), "on+shard/limit": round(row["on"]["of_limit_shard"], 3)}), flush=True)
    finally:
        if pool is not None:
            await pool.__aexit__(None, None, None)
        if raw is not None:
            raw.close()
    return rows


def report(args: argparse.Namespace, all_rows: list[dict[str, Any]], wall: float, before: float, after: float) -> str:
    rows = [r for r in all_rows if r["shape"] not in POOL_SHAPES]
    lines = ["# Workload-aware order: the pipeline against raw vLLM on prefix-heavy workloads", "",
             f"`{' '.join(sys.argv)}` on {platform.node()} ({os.cpu_count()} CPUs, shared with other sessions), "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {wall:.0f} s in all; 1-min load average "
             f"{before} before, {after} after (2 cores). vLLM-CPU 0.32, the tiny model, KV cache limited to "
             f"{args.blocks} blocks of {CPU_BLOCK} tokens (`num_gpu_blocks_override`), so the distinct prefixes do not fit. "
             + (f"Every record decodes exactly {args.output} tokens at temperature 0. " if not args.stop else
                f"Every record decodes at most {args.output} tokens at temperature 0, with stop strings {args.stop} (below). ")
             + "raw = one `LLM.generate` of the prompts in "
             "input order (tokenising included, as for text prompts); limit = the same engine (the raw bench's `LLM` object, the pipeline's engine configuration and cache limit) given each distinct request once, in prefix order, in one `LLM.generate` call (each distinct prefix "
             "computed once, each distinct request once; `bench/_limit.py`), in records/s of every input record; on / off = the pipeline's infer phase (InProcessPool, streaming "
             "engine, one round, shard_records = records / 4: 4 shards by count, with the layout on each ending between families within 25%) with `layout.prefix` on (the default) / off; every other pipeline setting is main's "
             "default (identical greedy requests run once per worker: `pool.dedup`). Each engine's prefix cache is emptied "
             "before every measurement. Each measurement starts once less than half a core is busy (`_raw_vllm.settle`: an engine's compute process spins its core for ~1 s after its last step). vLLM-CPU computes on one core of these 2 (its own binding keeps the other for its scheduler); a local pool's two workers each compute on a core of their own (`pool.launchers.devices`). Records/s (output tok/s = records/s x "
             f"{args.output}). Ratios are within the same repeat, measured back to back.", ""]
    lines += ["| shape | repeat | records | prompt tokens (mean) | raw rec/s | limit rec/s | on rec/s | off rec/s | on / raw | off / raw | on / limit | on / limit, shard step included | raw / limit | load |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pt = r["raw"]["prompt_tokens"] / r["records"]
        loads = [r[p]["load"] for p in ("raw", "limit", "on", "off")]
        lines.append(f"| {r['shape']} | {r['repeat']} | {r['records']} | {pt:,.0f} | {r['raw']['records_s']:.1f} | "
                     f"{r['limit']['records_s']:.1f} | {r['on']['records_s']:.1f} | {r['off']['records_s']:.1f} | "
                     f"{r['on']['vs_raw']:.2f} | {r['off']['vs_raw']:.2f} | {r['on']['of_limit']:.2f} | {r['on']['of_limit_shard']:.2f} | {r['raw']['of_limit']:.2f} | "
                     f"{min(x[0] for x in loads)}..{max(x[1] for x in loads)} |")
    lines += ["", "Median per shape (output tok/s = records/s x %d):" % args.output, "",
              "| shape | raw tok/s | on tok/s | on / raw | off / raw | on / limit | on / limit, shard step included | target |", "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes.split(","):
        rs = [r for r in rows if r["shape"] == shape]
        if not rs:
            continue
        med = {k: statistics.median(r[p]["vs_raw" if k.endswith("raw") else "of_limit"] for r in rs)
               for k, p in (("on/raw", "on"), ("off/raw", "off"), ("on/limit", "on"))}
        med["on+shard/limit"] = statistics.median(r["on"]["of_limit_shard"] for r in rs)
        raw_tok = statistics.median(r["raw"]["tok_s"] for r in rs)
        on_tok = statistics.median(r["on"]["tok_s"] for r in rs)
        target = ">= 0.97 x raw" if shape == "control" else ">= 2 x raw"
        lines.append(f"| {shape} | {raw_tok:,.0f} | {on_tok:,.0f} | {med['on/raw']:.2f} | {med['off/raw']:.2f} | {med['on/limit']:.2f} | {med['on+shard/limit']:.2f} | {target} |")
    heavy = [x for x in args.shapes.split(",") if x != "control" and any(r["shape"] == x for r in rows)]

    def med(shape: str, path: str, key: str) -> float:
        return statistics.median(r[path][key] for r in rows if r["shape"] == shape)

    if heavy:
        lines += ["", "Reading it: on the prefix-heavy shapes the pipeline ran "
                  + " / ".join(f"{med(x, 'on', 'vs_raw'):.2f}" for x in heavy) + f" x raw in input order ({', '.join(heavy)}; "
                  "median of the repeats), " + " / ".join(f"{med(x, 'on', 'of_limit'):.2f}" for x in heavy) + " of the limit's records/s ("
                  + " / ".join(f"{med(x, 'on', 'of_limit_shard'):.2f}" for x in heavy) + " with the shard step, where the layout "
                  "pass runs, added to the phase; target >= 0.95); "
                  "with the layout off " + " / ".join(f"{med(x, 'off', 'vs_raw'):.2f}" for x in heavy) + " x raw (on `repeats` "
                  "the off run gains as much: `pool.dedup` runs each distinct greedy request once either way, and the layout "
                  "adds nothing to it). Raw in input order recomputes what the cache evicted: it reached "
                  + " / ".join(f"{med(x, 'raw', 'of_limit'):.2f}" for x in heavy) + " of the limit. A ratio to the limit above 1 "
                  "is the spread of a single raw measurement on this shared machine (the limit's own rec/s varies by as much "
                  "between repeats)."]
    if any(r["shape"] == "control" for r in rows):
        lines += ["", f"The control ran {med('control', 'on', 'vs_raw'):.2f} x raw with the layout on and "
                  f"{med('control', 'off', 'vs_raw'):.2f} x with it off: nothing was shared, the text pass said so, no record was "
                  "tokenised on the driver and `sharded/` kept its order."]
    lines += ["", "The layout pass in each `on` run's shard step (ledger/shard.json `layout`): blocks of the signatures, the share "
              "prefix order adds over input order, the shard boundaries that still cut through shared blocks (`cuts_shared`: shards end between families, placement.shard_cuts), and its cost on the driver (signing every record by text; where the order "
              "pays, tokenising it with the model's tokenizer too; then the external sort):", "",
              "| shape | repeat | applied | blocks | gain | cuts through shared blocks | signing s | sorting s | shard step s (on) | shard step s (off) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lay = r["on"]["layout"] or {}
        lines.append(f"| {r['shape']} | {r['repeat']} | {lay.get('applied')} | {lay.get('blocks')} | {lay.get('gain', 0):.1%} | "
                     f"{lay.get('cuts_shared')} | {lay.get('sign_s')} | {lay.get('sort_s')} | {r['on']['shard_s']:.2f} | {r['off']['shard_s']:.2f} |")
    return "\n".join(lines + stops_report(args, rows) + counters_report(rows)
                     + pool_report(args, [r for r in all_rows if r["shape"] in POOL_SHAPES])) + "\n"


def stops_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """With ``--stop``: what the stop strings did, and whether every path decoded the same texts."""
    if not args.stop:
        return []
    lines = ["", f"## Stop strings: {', '.join(map(repr, args.stop))}", "",
             f"Every path asked for at most {args.output} tokens at temperature 0 with these stop strings (no `min_tokens`): "
             "vLLM detokenises every request at every step to look for them, raw `LLM.generate` and the pipeline's streaming "
             "engine alike. Output tokens decoded, records a stop string ended (raw), and whether the pipeline's approved texts "
             "(`on` and `off`, in record order) and token counts are raw's exactly.", "",
             "| shape | repeat | raw tokens | on tokens | off tokens | records stopped (raw / on / off) | same texts and tokens | on / raw | off / raw |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['repeat']} | {r['raw']['tokens']:,} | {r['on']['tokens']:,} | {r['off']['tokens']:,} | "
                     f"{r['raw'].get('stopped')} / {r['on'].get('stopped')} / {r['off'].get('stopped')} | "
                     f"{'yes' if r.get('same_output') else 'NO'} | {r['on']['vs_raw']:.3f} | {r['off']['vs_raw']:.3f} |")
    lines += ["", "CPU seconds per process during each measurement (`engine_ceiling.CpuMeter`): the front end is raw's helper "
              "process for raw (tokenising, `LLM.generate`'s output processing and detokenising) and this process for the "
              "pipeline (the pipeline, and vLLM's `AsyncLLM` output handling on its event loop); on 2 cores every front-end "
              "CPU-second is taken from the engine core or the model worker.", "",
              "| shape | repeat | path | wall s | front end | engine core | model worker | elsewhere on the machine |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for path in ("raw", "on", "off"):
            c = r[path].get("cpu_s") or {}
            front = c.get("raw frontend", 0.0) if path == "raw" else c.get("driver", 0.0)
            lines.append(f"| {r['shape']} | {r['repeat']} | {path} | {r[path]['seconds']:.2f} | {front:.2f} | "
                         f"{c.get('engine core', 0.0):.2f} | {c.get('model worker', 0.0):.2f} | {c.get('elsewhere', 0.0):.2f} |")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == shape]
        lines += ["", f"{shape}: median on / raw **{statistics.median(r['on']['vs_raw'] for r in rs):.3f}**, off / raw "
                  f"**{statistics.median(r['off']['vs_raw'] for r in rs):.3f}** over {len(rs)} repeats, with stop strings."]
    return lines


def counters_report(rows: list[dict[str, Any]]) -> list[str]:
    """The engine's own scheduler figures per update (``_limit.StepCounters``): where the limit's rest goes."""
    rows = [r for r in rows if "engine" in r["limit"]]
    if not rows:
        return []
    lines = ["", "## The engine's counters: the limit against the pipeline", "",
             "vLLM's scheduler figures at every update it hands its stat loggers (about one engine step), over the "
             "steps with a request running: steps, running requests (mean / median / max), waiting requests (mean), "
             "requests preempted and looked up again, the share of prompt tokens looked up that the prefix cache "
             "supplied, and for `on` the requests the pipeline had in flight at the engine (its `StreamGate`, mean) and "
             "when the first step ran after the measurement began (s; the pipeline's includes its shard step).", "",
             "| shape | repeat | path | rec/s | steps | running mean / p50 / max | waiting mean | preempted | cache hits | "
             "in flight mean | first step s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for path in ("limit", "on", "raw"):
            e = r[path].get("engine") or {}
            if not e:
                continue
            flight = f"{e['in_flight_mean']:.1f}" if e.get("in_flight_mean") is not None else "-"
            first = f"{e['first_step_s']:.2f}" if e.get("first_step_s") is not None else "-"
            lines.append(f"| {r['shape']} | {r['repeat']} | {path} | {r[path]['records_s']:.1f} | {e['steps']} | "
                         f"{e['running_mean']:.1f} / {e['running_p50']} / {e['running_max']} | {e['waiting_mean']:.1f} | "
                         f"{e['preempted']} | {e['hit_share']:.1%} | {flight} | {first} |")
    return lines


def pool_report(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[str]:
    """The section of the shapes run on 2 local workers: affinity on against off."""
    if not rows:
        return []
    lines = ["", "## Prefix affinity on 2 workers: a long preamble over distinct documents", "",
             "`preamble_docs`: a ~2.4 KB instruction preamble every record has, then one of "
             f"{max(1, args.records // 8)} short documents and one of 8 questions about it (interleaved). The pipeline's "
             "infer phase (one round, `layout.prefix` on, shard_records = records / 4) on a pool of 2 local workers "
             "(`LocalLauncher`, 10 slots each, the same vLLM-CPU engine and cache limit as above), each measurement on a "
             "pool started for it so every worker starts with an empty prefix cache; `pool.affinity` on (the default) "
             "against off (the least-loaded worker, ties at random), in alternating order. Before issue 27 item 7 a "
             "preamble longer than 512 tokens of text named every shard one family and all 4 tasks went to one worker.", "",
             "| repeat | records | shards | affinity rec/s | no affinity rec/s | affinity / off | tasks per worker (affinity) | "
             "tasks per worker (off) | kept / moved | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, o = r["affinity"], r["no_affinity"]
        lines.append(f"| {r['repeat']} | {r['records']} | {a['shards']} | {a['records_s']:.1f} | {o['records_s']:.1f} | "
                     f"{a['vs_off']:.2f} | {'/'.join(map(str, a['per_worker']))} | {'/'.join(map(str, o['per_worker']))} | "
                     f"{a['kept_moved'][0]} / {a['kept_moved'][1]} | {min(a['load'][0], o['load'][0])}..{max(a['load'][1], o['load'][1])} |")
    ratio = statistics.median(r["affinity"]["vs_off"] for r in rows)
    even = all(max(r["affinity"]["per_worker"]) - min(r["affinity"]["per_worker"]) <= 1 for r in rows)
    lines += ["", f"Median affinity / off: **{ratio:.2f}** (target >= 1.00 within the spread of one measurement on this "
              "shared machine); with affinity the tasks dispatched at once were "
              + ("split evenly over the two workers in every repeat." if even else "NOT split evenly in every repeat (see the table).")]
    return lines


def shape_arguments(doc: str, report: str) -> argparse.ArgumentParser:
    """The options of a bench over these shapes (this one and ``bench/prefill_ideal.py``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=240, help="records per shape (about)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output", type=int, default=32, help="output tokens per record")
    ap.add_argument("--blocks", type=int, default=100, help="KV cache blocks of every engine (num_gpu_blocks_override)")
    ap.add_argument("--model", help="model directory (default: the tiny model, built here)")
    ap.add_argument("--report", help=f"report path (default bench/reports/{report})")
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = shape_arguments(__doc__, "workload_aware.md")
    ap.add_argument("--stop", action="append", help="a stop string every record gets (repeatable): at most --output tokens, "
                    "no min_tokens, on every path")
    ap.add_argument("--signature", choices=("auto", "tokens", "text"), help="the pipeline's layout.signature (default: "
                    "main's, auto); tokens: the model's tokenizer, where the text pass's 4 characters a token misjudge "
                    "the tiny model's ~1.7")
    args = ap.parse_args()
    if args.raw_server:
        return raw_server(args.model, args.blocks)
    _raw_vllm.run_shape_bench(__file__, args, "workload-aware-", measure, report, REPORTS / "workload_aware.md")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
