"""Prefix-aware layout (pipeline.placement) and cache-friendly submission order, end to end.

Under any layout the same records end in the same terminal states (seeded random
workloads, on and off); off is today's layout; families sit together; work is skipped
when order cannot pay; a driver killed mid shard pass resumes without loss.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, RunLayout, run_pipeline
from batch_inference.pipeline import placement as placement_mod
from batch_inference.pipeline.runner import open_runner
from batch_inference.prompting import RequestBuilder
from batch_inference.prompting.prefix import PrefixSigner, shared_blocks
from batch_inference.rows import INPUT
from batch_inference.storage import JsonlDir, JsonlFile, reshard
from batch_inference_tests.pipeline.helpers import CountingRunner

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


def _doc(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(rng: random.Random, *, docs: int, questions: int, singles: int, preamble: bool, broken: int = 0) -> list[dict[str, Any]]:
    """Documents x questions interleaved (every document once per question), singletons, bad records."""
    texts = [_doc(rng, rng.randrange(40, 160)) for _ in range(docs)]
    recs: list[dict[str, Any]] = [{"doc": texts[d], "q": f"question {q} on this?"} for q in range(questions) for d in range(docs)]
    recs += [{"doc": _doc(rng, rng.randrange(5, 120)), "q": "alone?"} for _ in range(singles)]
    recs += [{"q": "no document field"} for _ in range(broken)]  # missing_field: a permanent error
    rng.shuffle(recs) if rng.random() < 0.5 else None
    if preamble:
        for r in recs:
            r["doc"] = "You are a careful reader. Read the document and answer. " * 3 + r.get("doc", "")
    return recs


def write(path: Path, recs: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    return path


def spec_for(tmp: Path, src: Path, *, run: str, prefix: bool, **over: Any) -> PipelineSpec:
    data: dict[str, Any] = {
        "run": run, "input": str(src), "output": str(tmp / "out"),
        "engine": {"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.0002, "latency_b_s": 0.0}},
        "infer": {"template": "Document: {doc}\nQuestion: {q}\nAnswer:", "sampling": {"max_tokens": 6, "seed": 3}},
        "judge": {"kind": "llm", "template": "Question: {q}\nAnswer: {result}\nVerdict:"},
        "strategy": "rounds", "max_rounds": 3, "max_attempts": 4, "shard_records": 25, "chunk_size": 10,
        "pool": {"concurrency": 3, "retries": 0, "batcher": {"batch_timeout_s": 0.002}},
        "layout": {"prefix": prefix},
    }
    data.update(over)
    return PipelineSpec.parse(data)


def terminal_states(spec: PipelineSpec) -> dict[str, tuple[str, int, Any]]:
    """id -> (terminal state, attempts, result) over every terminal source of the run."""
    out: dict[str, tuple[str, int, Any]] = {}
    for src in PipelineRun(spec).terminal_sources():
        if src.state == "input":
            continue
        for url in src.urls:
            files = (JsonlDir(url).shards() if JsonlDir(url).exists_sync() else []) if src.is_dir else [JsonlFile(url)]
            for f in files:
                for rec in f.iter_records_sync():
                    state = rec.get("status", src.state) if src.status_field else src.state
                    assert rec["id"] not in out, f"{rec['id']} in two terminal states"
                    out[rec["id"]] = (state, rec.get("attempts", 0), rec.get("result"))
    return out


def sharded_ids(spec: PipelineSpec) -> list[str]:
    return [r["id"] for r in JsonlDir(RunLayout(spec.output, spec.run).sharded).iter_records_sync()]


def signatures(spec: PipelineSpec, url: str) -> list[bytes]:
    builder = RequestBuilder(spec.infer)
    signer = PrefixSigner.for_engine(spec.engine)
    recs = list(JsonlDir(url).iter_records_sync())
    return [s.blocks for s in signer.sign([placement_mod.record_prompt(builder, r) for r in recs])]


@pytest.mark.parametrize("seed", range(6))
async def test_any_layout_ends_every_record_in_the_same_terminal_state(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    recs = workload(rng, docs=rng.randrange(1, 12), questions=rng.randrange(1, 6), singles=rng.randrange(0, 30),
                    preamble=rng.random() < 0.5, broken=rng.randrange(0, 3))
    src = write(tmp_path / "in.jsonl", recs)
    strategy = ["rounds", "hybrid", "in_place"][seed % 3]
    shard_records = rng.randrange(5, 40)
    outcomes = {}
    for prefix in (True, False):
        spec = spec_for(tmp_path, src, run=f"r-{prefix}", prefix=prefix, strategy=strategy, shard_records=shard_records)
        summary = await run_pipeline(spec)
        assert summary.conservation["ok"], summary.conservation
        outcomes[prefix] = terminal_states(spec)
        assert sorted(sharded_ids(spec)) == sorted(f"{i:012d}" for i in range(len(recs)))
    assert outcomes[True] == outcomes[False]
    assert len(outcomes[True]) == len(recs)


async def test_off_is_todays_layout_and_submission_order(tmp_path: Path) -> None:
    recs = workload(random.Random(7), docs=8, questions=4, singles=5, preamble=False)
    src = write(tmp_path / "in.jsonl", recs)
    spec = spec_for(tmp_path, src, run="off", prefix=False)
    async with open_runner(spec) as inner:
        runner = CountingRunner(inner)
        seen: list[str] = []
        run_task = runner.run_task

        async def record_order(task: Any) -> Any:
            seen.append(task.order)
            return await run_task(task)

        runner.run_task = record_order  # type: ignore[method-assign]
        await run_pipeline(spec, runner=runner)
    plain = tmp_path / "plain"
    reshard(str(src), str(plain), records_per_shard=spec.shard_records)
    ours = JsonlDir(RunLayout(spec.output, spec.run).sharded)
    assert [f.name for f in ours.shards()] == [f.name for f in JsonlDir(str(plain)).shards()]
    for a, b in zip(ours.shards(), JsonlDir(str(plain)).shards()):  # the same records, each with its input position
        assert [{k: v for k, v in r.items() if k != INPUT} for r in a.iter_records_sync()] == list(b.iter_records_sync())
        assert [r[INPUT]["row"] for r in a.iter_records_sync()] == [int(r["id"]) for r in b.iter_records_sync()]
    assert set(seen) == {"input"}
    assert PipelineRun(spec).ledger.view().shard.layout is None


async def test_families_sit_together_and_recompaction_keeps_the_order(tmp_path: Path) -> None:
    recs = workload(random.Random(3), docs=10, questions=5, singles=0, preamble=False)
    src = write(tmp_path / "in.jsonl", recs)
    spec = spec_for(tmp_path, src, run="on", prefix=True, shard_records=10, max_rounds=2)
    shard = await PipelineRun(spec).shard()
    p = shard.layout
    assert p is not None and p.applied and p.gain > 0.5 and p.shared_sorted > p.shared_input, p
    sharded = JsonlDir(RunLayout(spec.output, spec.run).sharded)
    for f in sharded.shards():  # 10 documents x 5 questions, 10 records a shard: each shard two whole documents
        assert len({r["doc"] for r in f.iter_records_sync()}) == 2
    sigs = signatures(spec, sharded.url)
    assert sigs == sorted(sigs)
    summary = await run_pipeline(spec)
    assert summary.conservation["ok"]
    pending = RunLayout(spec.output, spec.run).pending(1)
    later = signatures(spec, pending)
    assert 0 < len(later) < len(recs) and later == sorted(later)  # a subsequence of a sorted sequence


async def test_order_that_cannot_pay_is_not_written(tmp_path: Path) -> None:
    rng = random.Random(5)
    for name, recs in (("control", workload(rng, docs=0, questions=0, singles=60, preamble=False)),
                       ("preamble", workload(rng, docs=0, questions=0, singles=60, preamble=True))):
        src = write(tmp_path / f"{name}.jsonl", recs)
        spec = spec_for(tmp_path, src, run=name, prefix=True)
        p = (await PipelineRun(spec).shard()).layout
        assert p is not None and not p.applied and "kept input order" in p.reason, p
        assert sharded_ids(spec) == [f"{i:012d}" for i in range(len(recs))]
        if name == "preamble":  # every record shares the preamble, in any order: no gain from sorting
            assert p.shared_input >= 2 * (len(recs) - 1) and p.gain < spec.layout.min_gain
        assert not Path(RunLayout(spec.output, spec.run).layout_spill).exists()


async def test_prefix_order_tasks_write_rows_in_input_order(tmp_path: Path) -> None:
    recs = workload(random.Random(9), docs=6, questions=3, singles=4, preamble=False)
    src = write(tmp_path / "in.jsonl", recs)
    rows = {}
    for prefix in (True, False):
        spec = spec_for(tmp_path, src, run=f"o-{prefix}", prefix=prefix, layout={"prefix": prefix, "min_gain": 1.0})
        await run_pipeline(spec)  # min_gain 1.0: the layout is never written, only the submission order differs
        inferred = JsonlDir(RunLayout(spec.output, spec.run).inferred(0))
        rows[prefix] = [(r["id"], r["result"]) for r in inferred.iter_records_sync()]
    assert rows[True] == rows[False]


KILLER = """
import asyncio, os, sys
from batch_inference.pipeline import PipelineRun, PipelineSpec
from batch_inference.pipeline import placement
from batch_inference.storage import sort

spec = PipelineSpec.load(sys.argv[1])
where, after = sys.argv[2], int(sys.argv[3])
placement.SIGN_BATCH = 7
if where == "sign":
    sign = placement.PrefixSigner.sign
    calls = [0]
    def dying_sign(self, prompts):
        calls[0] += 1
        if calls[0] > after:
            os._exit(9)  # no cleanup, no finally: as SIGKILL
        return sign(self, prompts)
    placement.PrefixSigner.sign = dying_sign
else:
    iter_sorted = sort.ExternalSort.iter_sorted
    passes = [0]
    def dying_iter(self):
        passes[0] += 1
        for n, item in enumerate(iter_sorted(self)):
            if passes[0] == 2 and n == after:  # the second pass is the rewrite of sharded/
                os._exit(9)
            yield item
    sort.ExternalSort.iter_sorted = dying_iter
asyncio.run(PipelineRun(spec).shard())
"""


@pytest.mark.process
@pytest.mark.parametrize(("where", "after"), [("sign", 3), ("rewrite", 40)])
async def test_a_driver_killed_mid_shard_pass_resumes_without_loss(tmp_path: Path, where: str, after: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    recs = workload(random.Random(11), docs=9, questions=6, singles=10, preamble=False)
    src = write(tmp_path / "in.jsonl", recs)
    spec = spec_for(tmp_path, src, run="killed", prefix=True, shard_records=8, layout={"run_bytes": 1 << 20})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.public_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", KILLER, str(spec_path), where, str(after)], env=env, capture_output=True, timeout=120)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    layout = RunLayout(spec.output, spec.run)
    ledger = Path(layout.ledger)
    assert (ledger / "shard-input.json").exists() and not (ledger / "shard.json").exists()
    manifest = Path(layout.sharded) / "_manifest.json"
    if where == "sign":  # killed before the rewrite: sharded/ is intact and is not resharded again
        assert manifest.exists()
        monkeypatch.setattr("batch_inference.pipeline.passes.shard_input", lambda *a, **k: pytest.fail("resharded again"))
    else:  # killed while rewriting: sharded/ is half-written (no manifest), so it is sharded again
        assert not manifest.exists()
    shard = await PipelineRun(spec).shard()
    monkeypatch.undo()
    assert shard.records == len(recs) and shard.layout is not None and shard.layout.applied
    assert sorted(sharded_ids(spec)) == sorted(f"{i:012d}" for i in range(len(recs)))  # every record once
    sigs = signatures(spec, layout.sharded)
    assert sigs == sorted(sigs)
    assert not Path(layout.layout_spill).exists()
    summary = await run_pipeline(spec)
    assert summary.conservation["ok"] and summary.records == len(recs)


def test_shared_blocks_in_sorted_order_is_the_tree_of_prefixes() -> None:
    # the layout's gain counts what adjacent records share; in prefix order that is every
    # block but the distinct ones (each prefix-tree node computed once)
    rng = random.Random(0)
    recs = workload(rng, docs=7, questions=4, singles=9, preamble=True)
    signer = PrefixSigner.for_engine(PipelineSpec.model_fields["engine"].annotation(kind="simulated"))  # type: ignore[misc]
    builder = RequestBuilder(spec_for(Path("/tmp"), Path("/tmp/x"), run="x", prefix=True).infer)
    sigs = sorted(s.blocks for s in signer.sign([placement_mod.record_prompt(builder, r) for r in recs]))
    shared = sum(shared_blocks(a, b) for a, b in zip([b""] + sigs, sigs))
    from batch_inference.prompting.prefix import distinct_blocks

    distinct, total = distinct_blocks(sigs)
    assert total - shared == distinct


def tokenizer_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The prompts each call of the model's tokenizer (``HFTokens.pack``) was given, as they come."""
    from batch_inference.prompting.prefix import HFTokens

    packed: list[int] = []
    pack = HFTokens.pack

    def counting(self: HFTokens, prompts: Any, max_tokens: Any) -> Any:
        packed.append(len(prompts))
        return pack(self, prompts, max_tokens)

    monkeypatch.setattr(HFTokens, "pack", counting)
    return packed


async def test_the_models_tokens_are_computed_only_when_order_pays(tmp_path: Path, tiny_model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    packed = tokenizer_calls(monkeypatch)
    rng = random.Random(13)
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    for name, recs, pays in (("control", workload(rng, docs=0, questions=0, singles=40, preamble=True), False),
                             ("docs", workload(rng, docs=6, questions=5, singles=4, preamble=False), True)):
        packed.clear()
        src = write(tmp_path / f"{name}.jsonl", recs)
        spec = spec_for(tmp_path, src, run=name, prefix=True, engine=engine, layout={"prefix": True, "signature": "tokens"})
        p = (await PipelineRun(spec).shard()).layout
        assert p is not None and p.applied is pays, p
        if not pays:  # the text pass decided: no record went through the tokenizer
            assert packed == [] and p.signature.startswith("text") and p.text_gain < spec.layout.min_gain
            continue
        assert sum(packed) == len(recs) and "tokenizer" in p.signature and p.gain > 0.5
        from transformers import AutoTokenizer

        from batch_inference.prompting.prefix import HFTokens

        signer = PrefixSigner(HFTokens(AutoTokenizer.from_pretrained(str(tiny_model_dir))), block_size=16, max_blocks=128)
        builder = RequestBuilder(spec.infer)
        rows = list(JsonlDir(RunLayout(spec.output, spec.run).sharded).iter_records_sync())
        sigs = [s.blocks for s in signer.sign([placement_mod.record_prompt(builder, r) for r in rows])]
        assert sigs == sorted(sigs)  # in the order of the model's own block hashes
        # the token pass's sorted-order figures are counted while the records are rewritten
        from batch_inference.prompting.prefix import common_blocks

        assert p.shared_sorted == sum(shared_blocks(a, b) for a, b in zip([b""] + sigs, sigs)) > 0
        assert p.common_blocks == common_blocks(sigs) and p.blocks == sum(len(x) // 8 for x in sigs)


async def test_auto_signature_tokenises_only_chat_records(tmp_path: Path, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``layout.signature: auto`` (the default): plain prompts are laid out by their text
    (the tokenizer is never called, the shards are the ``text`` layout's, byte for byte),
    whether the template says so or the records do; chat records, mixed in, go through the
    model's tokenizer, and only they."""
    packed = tokenizer_calls(monkeypatch)
    rng = random.Random(17)
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    recs = workload(rng, docs=6, questions=5, singles=4, preamble=False)
    plain = [{"prompt": f"Document: {r['doc']}\nQuestion: {r['q']}\nAnswer:"} for r in recs]
    chat = [{"messages": [{"role": "user", "content": p["prompt"]}]} for p in plain[:12]]
    laid: dict[str, list[bytes]] = {}
    for name, rows, infer in (("template", recs, None), ("text", recs, None),
                              ("records", plain, {"sampling": {"max_tokens": 6}}),
                              ("mixed", plain + chat, {"sampling": {"max_tokens": 6}})):
        packed.clear()
        over: dict[str, Any] = {"engine": engine, "layout": {"prefix": True, "signature": "text" if name == "text" else "auto"}}
        if infer is not None:
            over["infer"] = infer
        spec = spec_for(tmp_path, write(tmp_path / f"{name}.jsonl", rows), run=name, prefix=True, **over)
        assert spec.layout.signature == ("text" if name == "text" else "auto")
        p = (await PipelineRun(spec).shard()).layout
        assert p is not None and p.applied and p.records == len(rows), p
        laid[name] = _dir_bytes(RunLayout(spec.output, spec.run).sharded)
        assert sum(packed) == (len(chat) if name == "mixed" else 0), name
        assert p.signature.startswith("text for plain prompts") is (name != "text")
    assert laid["template"] == laid["text"]  # the text layout's shards, byte for byte
    def bodies(lines: list[bytes]) -> list[bytes]:
        return [orjson.dumps({k: v for k, v in orjson.loads(line).items() if k not in ("id", INPUT)}) for line in lines]

    assert sorted(bodies(laid["mixed"])) == sorted(orjson.dumps(r) for r in plain + chat)  # nothing lost, nothing added
    mixed_plain = [line for line in bodies(laid["mixed"]) if b'"prompt"' in line]
    assert mixed_plain == bodies(laid["records"])  # the plain records in the text layout's order


def _chain(*blocks: bytes) -> bytes:
    from batch_inference.engines.blocks import chain_hashes

    return chain_hashes(b"".join(blocks), 4)


def test_shards_end_between_families_within_the_slack() -> None:
    """Families of 7 records (sharing 3 blocks) under a preamble block every record has,
    cut for shards of 20: each shard ends at a family boundary, 15 to 25 records."""
    keys = [_chain(b"PREA", f"F{f:03d}".encode()[:4], b"more", f"q{q:03d}".encode()[:4]) for f in range(30) for q in range(7)]
    cuts = list(placement_mod.shard_cuts(iter(keys), 20, 5))
    sizes = [n for n, _ in cuts]
    assert sum(sizes) == len(keys) and all(15 <= n <= 25 for n in sizes[:-1]), sizes
    ends = list(itertools.accumulate(sizes))[:-1]
    assert all(e % 7 == 0 for e in ends), ends  # never inside a family
    assert all(shared == 1 for _, shared in cuts[:-1])  # the preamble alone crosses each cut
    # one family larger than any window: cut where the shard is due, every cut inside it
    big = [_chain(b"same", b"fam!", f"{i:04d}".encode()) for i in range(100)]
    assert list(placement_mod.shard_cuts(iter(big), 20, 5)) == [(20, 2)] * 4 + [(20, 0)]
    # nothing shared: shards of exactly 20, as sharding cuts them
    lone = [_chain(f"{i:04d}".encode(), b"tail") for i in range(50)]
    assert [n for n, _ in placement_mod.shard_cuts(iter(lone), 20, 5)] == [20, 20, 10]
    assert [n for n, _ in placement_mod.shard_cuts(iter(lone[:3]), 1, 0)] == [1, 1, 1]


@pytest.mark.parametrize("write_lines", [3, 1024])  # lines written before the window comes, or all held until the cut
async def test_a_family_smaller_than_a_shard_is_never_cut(tmp_path: Path, write_lines: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_mod, "WRITE_LINES", write_lines)
    recs = workload(random.Random(5), docs=30, questions=8, singles=0, preamble=True)
    src = write(tmp_path / "in.jsonl", recs)
    spec = spec_for(tmp_path, src, run="on", prefix=True, shard_records=60)
    shard = await PipelineRun(spec).shard()
    assert shard.layout is not None and shard.layout.applied
    sharded = JsonlDir(RunLayout(spec.output, spec.run).sharded)
    docs = [{r["doc"] for r in f.iter_records_sync()} for f in sharded.shards()]
    assert all(a.isdisjoint(b) for i, a in enumerate(docs) for b in docs[i + 1:])  # each document in one shard
    sizes = [len(list(f.iter_records_sync())) for f in sharded.shards()]
    assert sum(sizes) == len(recs) and all(45 <= n <= 75 for n in sizes), sizes
    # the preamble every record has crosses every cut and names no family (prompting.prefix):
    # no cut is inside one
    assert shard.layout.common_blocks > 0 and shard.layout.cuts_shared == 0
    sigs = signatures(spec, sharded.url)
    assert sigs == sorted(sigs) and sorted(sharded_ids(spec)) == sorted(f"{i:012d}" for i in range(len(recs)))


async def test_recompaction_cuts_its_shards_between_families(tmp_path: Path) -> None:
    """Round 0's rejects keep the laid-out order; recompacted by count, shards of 10 would
    cut documents whose rejected questions straddle the 10th record. Between families,
    no recompacted shard cuts a document (cuts_shared 0), and every record ends as with
    the layout off."""
    recs = workload(random.Random(11), docs=14, questions=6, singles=0, preamble=False)
    src = write(tmp_path / "in.jsonl", recs)
    outcomes = {}
    for prefix in (True, False):
        spec = spec_for(tmp_path, src, run=f"r-{prefix}", prefix=prefix, shard_records=10, max_rounds=3)
        summary = await run_pipeline(spec)
        assert summary.conservation["ok"], summary.conservation
        outcomes[prefix] = terminal_states(spec)
        if not prefix:
            assert all(not r.recompact.families for r in PipelineRun(spec).ledger.view().rounds if r.recompact)
            continue
        layout = RunLayout(spec.output, spec.run)
        rounds = [r.recompact for r in PipelineRun(spec).ledger.view().rounds if r.recompact]
        assert len(rounds) == 2 and all(c.families and c.cuts_shared == 0 for c in rounds), rounds
        straddled = 0
        for r in (0, 1):
            rejected = [rec["doc"] for rec in JsonlDir(layout.rejected(r)).iter_records_sync()]
            straddled += sum(rejected[i - 1] == rejected[i] for i in range(10, len(rejected), 10))  # cut by count
            shards = JsonlDir(layout.pending(r + 1)).shards()
            docs = [[rec["doc"] for rec in f.iter_records_sync()] for f in shards]
            assert [d for shard in docs for d in shard] == rejected  # only cut, never reordered or lost
            assert all(set(a).isdisjoint(b) for i, a in enumerate(docs) for b in docs[i + 1:])  # each document in one shard
            assert all(8 <= len(d) <= 12 for d in docs[:-1]), [len(d) for d in docs]
            later = signatures(spec, layout.pending(r + 1))
            assert later == sorted(later)
        assert straddled > 0  # the workload has families a count cut would split
    assert outcomes[True] == outcomes[False]
    assert len(outcomes[True]) == len(recs)


async def test_the_ledger_counts_the_shards_the_layout_committed(tmp_path: Path) -> None:
    # 64 records resharded by 8 are 8 shards; cut between families of 6 they are 9 (issue 27 item 8)
    src = write(tmp_path / "in.jsonl", workload(random.Random(11), docs=9, questions=6, singles=10, preamble=False))
    spec = spec_for(tmp_path, src, run="count", prefix=True, shard_records=8)
    shard = await PipelineRun(spec).shard()
    committed = JsonlDir(RunLayout(spec.output, spec.run).sharded).manifest()
    assert shard.layout is not None and shard.layout.applied
    assert committed is not None and shard.shards == len(committed.shards) == 9
    assert PipelineRun(spec).ledger.view().shard.shards == 9  # what `status` and the sharded asset show


def _dir_bytes(url: str) -> list[bytes]:
    return [line for _, line in JsonlDir(url).iter_parsed_lines_sync()]


def test_layout_workers_are_the_cores_the_shards_and_the_records_allow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(12)), raising=False)
    assert placement_mod.layout_workers(None, 10_000_000, 500) == 12  # the driver's cores
    assert placement_mod.layout_workers(4, 10_000_000, 500) == 4
    assert placement_mod.layout_workers(None, 10_000_000, 3) == 3  # a worker signs whole shards
    assert placement_mod.layout_workers(None, 250_000, 500) == 2  # one per PARALLEL_MIN_RECORDS records
    assert placement_mod.layout_workers(None, 240, 4) == 1  # a bench-sized input: no process to start
    assert placement_mod.layout_workers(8, 240, 4, min_records=1) == 4
    assert [len(s) for s in placement_mod.input_slices([(f"s{i}", 10) for i in range(7)], 3)] == [3, 2, 2]
    assert placement_mod.input_slices([("a", 0), ("b", 5), ("c", 0)], 2) == [("a", "b"), ("c",)]


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("signature", ["tokens", "text"])
async def test_the_pass_spread_over_processes_writes_the_serial_pass_bytes(tmp_path: Path, tiny_model_dir: Path,
                                                                            signature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``layout.workers``: each process signs consecutive input shards into sorted runs the
    merge adopts in input order, so the laid-out directory is the serial pass's, byte for
    byte (equal signatures: exact repeats, kept in input order), and so are its figures."""
    monkeypatch.setattr(placement_mod, "PARALLEL_MIN_RECORDS", 1)  # a small input, spread anyway
    rng = random.Random(21)
    recs = workload(rng, docs=12, questions=6, singles=20, preamble=True, broken=3)
    recs += [dict(r) for r in recs[:30]]  # exact repeats: equal signatures, whose order only input order decides
    src = write(tmp_path / "in.jsonl", recs)
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    out: dict[int, tuple[Any, list[bytes]]] = {}
    for workers in (1, 3):
        spec = spec_for(tmp_path, src, run=f"w{workers}", prefix=True, engine=engine, shard_records=20,
                        layout={"prefix": True, "signature": signature, "workers": workers, "run_bytes": 1 << 20})
        layout = (await PipelineRun(spec).shard()).layout
        out[workers] = (layout, _dir_bytes(RunLayout(spec.output, spec.run).sharded))
        spill = Path(RunLayout(spec.output, spec.run).layout_spill)
        assert not spill.exists() or not any(spill.rglob("*.zst"))  # the workers' runs are removed with the pass's
    serial, parallel = out[1][0], out[3][0]
    assert serial.workers == 1 and parallel.workers == 3 and parallel.applied
    assert ("tokenizer" in parallel.signature) is (signature == "tokens")
    assert len(out[3][1]) == len(recs) and out[3][1] == out[1][1]  # the same lines in the same order
    same = ("records", "blocks", "shared_input", "shared_sorted", "gain", "text_gain", "cuts_shared", "common_blocks")
    assert {k: getattr(parallel, k) for k in same} == {k: getattr(serial, k) for k in same}
    assert parallel.runs >= 3  # each worker spilled runs of its own, which the merge took


@pytest.mark.parametrize("signature", ["auto", "tokens"])
async def test_short_documents_share_blocks_at_the_models_characters_a_token(tmp_path: Path, tiny_model_dir: Path,
                                                                             signature: str) -> None:
    """Documents of ~380 characters x questions, 128-token blocks (vLLM-CPU's): under the tiny
    model's tokenizer (~1.4 characters a token) a document is two full blocks, under one
    512-character block of text at a constant 4 characters a token. The text pass signs at
    the model's characters a token, measured on the run's prompts, so the layout finds the
    shared blocks and applies, with either signature; a later process (a resumed run) signs
    with the same figure, so recompaction and the dispatch meet the layout's families."""
    rng = random.Random(41)
    docs = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(12)]
    recs = [{"doc": d, "q": f"question {q} on this?"} for q in range(6) for d in docs]
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    spec = spec_for(tmp_path, write(tmp_path / "short.jsonl", recs), run=f"short-{signature}", prefix=True, engine=engine,
                    layout={"prefix": True, "signature": signature, "block_size": 128})
    p = (await PipelineRun(spec).shard()).layout
    assert p is not None and p.applied and p.blocks >= len(recs), p
    assert 1.0 < p.chars_per_token < 2.0 and p.gain > 0.5
    later = PipelineRun(spec).ctx  # a new process's context: the figure comes from the ledger
    signer = later.signer()
    assert later.layout_common(signer) == p.common_blocks  # same signature: the layout's families
    builder = RequestBuilder(spec.infer)
    rows = list(JsonlDir(RunLayout(spec.output, spec.run).sharded).iter_records_sync())
    sigs = [s.blocks for s in signer.sign([placement_mod.record_prompt(builder, r) for r in rows])]
    assert sigs == sorted(sigs)  # laid out in the order this signer signs
    assert sum(shared_blocks(a, b) == 0 for a, b in zip(sigs, sigs[1:])) == len(docs) - 1  # each document's records together
    # a ledger from before the figure was recorded was laid out at 4 characters a token: signed so again
    shard = later.ledger.read(RunLayout.SHARD)
    del shard["layout"]["chars_per_token"]
    later.ledger.write(RunLayout.SHARD, shard)
    from batch_inference.prompting.prefix import text_tokens

    assert text_tokens(PipelineRun(spec).ctx.signer().tokenizer).chars == 4


async def test_nothing_shared_at_the_models_characters_a_token_keeps_input_order(tmp_path: Path,
                                                                                 tiny_model_dir: Path) -> None:
    """Distinct short prompts (nothing shared past a few words): measured at the model's
    characters a token the text pass still finds nothing to gain, and the input keeps its order."""
    rng = random.Random(43)
    recs = [{"doc": f"{rng.randrange(10**9)} " + " ".join(rng.choice(WORDS) for _ in range(60)), "q": "alone?"}
            for _ in range(60)]
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    spec = spec_for(tmp_path, write(tmp_path / "control.jsonl", recs), run="control-short", prefix=True, engine=engine,
                    layout={"prefix": True, "block_size": 128})
    p = (await PipelineRun(spec).shard()).layout
    assert p is not None and not p.applied and p.blocks > 0 and p.text_gain == 0.0, p
