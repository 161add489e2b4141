"""Prefix affinity in the pipeline: each shard's task names its prefix family, the same for
its infer and judge tasks, and on a real pool of two workers a family's shards run on one worker."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.pool.protocol import TaskResult, TaskSpec
from batch_inference_tests.pipeline.helpers import CountingRunner, spec_dict

FAMILY, DOCS = 15, 6  # a document's questions: 15 records, more than a shard of 10


def _documents(path: Path) -> None:
    """Each document asked FAMILY questions, the documents interleaved in the input."""
    with open(path, "wb") as f:
        for q in range(FAMILY):
            for d in range(DOCS):
                f.write(orjson.dumps({"prompt": f"document {d}: " + f"fact {d} is known. " * 120 + f"question {q}?"}) + b"\n")


class Recording(CountingRunner):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.specs: list[TaskSpec] = []

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        self.specs.append(spec)
        return await super().run_task(spec)


def _spec(tmp_path: Path, **pool: object) -> PipelineSpec:
    tmp_path.mkdir(parents=True, exist_ok=True)
    _documents(tmp_path / "input.jsonl")
    data = spec_dict(tmp_path, shard_records=10, chunk_size=10, max_rounds=1, pool={"concurrency": 4, **pool})
    data["engine"]["simulated"] = {"cost_model": "decode", "scheduling": "continuous", "greedy": "prompt",
                                   "prefix_cache": True, "profile": "h200-llama-8b", "decode": {"step_s": 1e-5}}
    return PipelineSpec.parse(data)


async def test_every_shard_names_its_family_for_infer_and_judge_alike(tmp_path: Path, inprocess_pool) -> None:
    # endpoints make it a pool of several workers; the run itself goes through an in-process pool
    spec = _spec(tmp_path, endpoints=["http://127.0.0.1:9"])
    async with inprocess_pool(spec.engine, concurrency=4) as pool:
        runner = Recording(pool)
        await run_pipeline(spec, runner=runner)
    by_kind: dict[str, dict[str, str | None]] = defaultdict(dict)
    for s in runner.specs:
        by_kind[s.kind][s.task_id.rsplit("/", 1)[1]] = s.affinity
    infer, judge = by_kind["infer"], by_kind["judge"]
    assert len(infer) == DOCS * FAMILY // 10 and all(infer.values())
    assert judge == infer  # a shard's judge task follows its infer task to the family's worker
    # laid out in prefix order, a document's 15 questions fill a shard and spill into the next:
    # both shards lead with that document, so they share its key; six documents, six keys
    assert len(set(infer.values())) == DOCS
    keys = [infer[i] for i in sorted(infer)]
    assert sum(1 for a, b in zip(keys, keys[1:]) if a == b) == len(keys) - DOCS


async def test_a_long_shared_preamble_names_no_family_the_documents_behind_it_do(tmp_path: Path, inprocess_pool) -> None:
    # 8 shards of 8 different documents, each behind the same 3 KB instruction preamble:
    # longer than any fixed prefix a family could be named by, it is what every record shares
    preamble = "Instructions: read the document below with care, then answer the question about it. " * 36
    assert len(preamble) > 3000
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "input.jsonl", "wb") as f:
        for d in range(8):
            for q in range(10):
                f.write(orjson.dumps({"prompt": preamble + f"document {d}: " + f"fact {d} is known. " * 40 + f"question {q}?"}) + b"\n")
    data = spec_dict(tmp_path, shard_records=10, chunk_size=10, max_rounds=1,
                     pool={"concurrency": 8, "endpoints": ["http://127.0.0.1:9"]})
    spec = PipelineSpec.parse(data)
    async with inprocess_pool(spec.engine, concurrency=8) as pool:
        runner = Recording(pool)
        await run_pipeline(spec, runner=runner)
    infer = {s.task_id: s.affinity for s in runner.specs if s.kind == "infer"}
    assert len(infer) == 8 and all(infer.values())
    assert len(set(infer.values())) == 8  # one family a document, not one for the preamble


async def test_affinity_off_or_in_process_names_no_family(tmp_path: Path, inprocess_pool) -> None:
    for pool_opts in ({"endpoints": ["http://127.0.0.1:9"], "affinity": False}, {}):
        spec = _spec(tmp_path / str(len(pool_opts)), **pool_opts)
        async with inprocess_pool(spec.engine, concurrency=4) as pool:
            runner = Recording(pool)
            await run_pipeline(spec, runner=runner)
        assert runner.specs and all(s.affinity is None for s in runner.specs)


@pytest.mark.process
async def test_on_two_workers_a_familys_shards_meet_one_worker(local_pool, tmp_path: Path) -> None:
    # slots to spare (a family's worker is never full; a full one passing its turn on: test_client.py)
    spec = _spec(tmp_path, launcher="local", concurrency=16)
    launcher = await asyncio.to_thread(local_pool, engine_config=spec.engine.model_dump(), replicas=2, concurrency=16)
    client = await asyncio.to_thread(launcher.client, retries=1)
    async with client:
        runner = Recording(client)
        await run_pipeline(spec, runner=runner)
    root = Path(spec.output) / spec.run / "ledger" / "progress"
    ran: dict[str, set[str]] = defaultdict(set)
    for s in runner.specs:
        step = f"round-00-{s.kind}"
        rec = orjson.loads((root / step / f"part-{int(s.task_id.rsplit('/', 1)[1]):05d}.json").read_bytes())
        ran[s.affinity or ""].add(rec["worker"])
    assert len(ran) == DOCS and all(len(workers) == 1 for workers in ran.values()), ran
    assert client.affinity_moved == 0 and client.affinity_kept == len(runner.specs)
