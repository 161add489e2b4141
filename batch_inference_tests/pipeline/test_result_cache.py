"""The cross-run result cache (pool.result_cache): a scheduled rerun computes only what is new.

A nightly run over a corpus, then the same corpus plus 10% new records under another run
name and the same output root: the second run's engines compute about 10% of the
requests (inference and judge), the old records' rows are the first run's (marked
``cached``), every record still ends in exactly one terminal state. A changed model file
never hits; sampled requests without a seed are never kept; ``cache.enabled: false`` turns
it off.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, run_pipeline
from batch_inference.pipeline.report import run_lines
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict


def _corpus(path: Path, n: int) -> Path:
    with open(path, "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"id": f"r{i}", "prompt": f"question number {i}"}) + b"\n")
    return path


def _spec(tmp_path: Path, run: str, src: Path, **overrides: Any) -> PipelineSpec:
    data = spec_dict(tmp_path, run=run, input=str(src), approval=1.0, **overrides)
    return PipelineSpec.parse(data)


def _results(spec: PipelineSpec) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in JsonlDir(PipelineRun(spec).layout.results).iter_records_sync()}


async def test_a_rerun_with_ten_percent_new_records_computes_only_the_new_ones(tmp_path: Path) -> None:
    first = await run_pipeline(_spec(tmp_path, "night-1", _corpus(tmp_path / "n1.jsonl", 200)))
    assert first.conservation["ok"] and first.result_cache_hits == 0
    assert first.engine_requests == 400  # 200 inferences + 200 judge calls, all computed
    spec2 = _spec(tmp_path, "night-2", _corpus(tmp_path / "n2.jsonl", 220))
    second = await run_pipeline(spec2)
    assert second.conservation["ok"] and second.approved == 220
    assert second.engine_requests == 40  # the 20 new records' inference and judge calls
    assert (second.result_cache_hits, second.result_cache_lookups) == (400, 440)
    assert second.result_cache_hit_rate == pytest.approx(400 / 440, abs=1e-4)
    rows1, rows2 = _results(_spec(tmp_path, "night-1", tmp_path / "n1.jsonl")), _results(spec2)
    for rid, row in rows1.items():  # the same answers and usage, marked as reused
        assert rows2[rid]["result"] == row["result"] and rows2[rid]["usage"] == row["usage"]
        assert rows2[rid]["cached"] is True and "cached" not in row
    assert all("cached" not in rows2[f"r{i}"] for i in range(200, 220))
    # the figures are in the ledger, in status and in the run's cache record
    view = PipelineRun(spec2).ledger.view()
    assert sum(p.result_cache_hits for r in view.rounds for p in r.phases) == 400
    status = "\n".join(run_lines(view))
    from rich.console import Console

    from batch_inference.pipeline.report import ledger_table

    console = Console(width=240)  # wide enough for every column, whatever the terminal
    with console.capture() as captured:  # the ledger table: each round's share answered by the cache
        console.print(ledger_table(view, "night-2"))
    table = captured.get()
    assert "reused" in table and any("round 0" in line and "91%" in line for line in table.splitlines())
    assert "result cache: 400 of 440" in status and "(91% hit rate)" in status and "engines ran 40 request(s)" in status
    assert second.result_cache["entries"] == 440 and second.result_cache["evicted"] == 0
    # and in the Dagster metadata of each round and of the results
    from batch_inference.defs.metadata import phase_metadata, result_cache_run_metadata

    rnd = {k: v.value for k, v in phase_metadata(view.rounds[0]).items()}
    assert (rnd["result_cache_hits"], rnd["result_cache_lookups"], rnd["engine_requests"]) == (400, 440, 40)
    assert rnd["result_cache_hit_rate"] == pytest.approx(400 / 440, abs=1e-4)
    run = {k: v.value for k, v in result_cache_run_metadata(second).items()}
    assert (run["result_cache_hits"], run["engine_requests"], run["result_cache.entries"]) == (400, 40, 440)


async def test_no_hit_after_the_model_files_change(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\x01" * 4096)
    src = _corpus(tmp_path / "in.jsonl", 60)
    engine = {"model": str(model)}
    await run_pipeline(_spec(tmp_path, "a", src, engine=engine))
    again = await run_pipeline(_spec(tmp_path, "b", src, engine=engine))
    assert again.result_cache_hits == again.result_cache_lookups == 120
    (model / "weights.bin").write_bytes(b"\x02" * 4096)  # retrained: same name, same size
    changed = await run_pipeline(_spec(tmp_path, "c", src, engine=engine))
    assert changed.result_cache_hits == 0 and changed.engine_requests == 120


@pytest.mark.slow
async def test_a_same_size_edit_in_the_middle_of_the_weights_is_never_answered_from_the_cache(tmp_path: Path) -> None:
    """A fine-tune that changes a middle layer keeps model.safetensors' size, and its first and
    last MiB: the rerun must be the edited model's answers (as with the cache off), not the
    old model's from the cache."""
    import asyncio

    from batch_inference.engines.tiny_model import make_tiny_model

    model = await asyncio.to_thread(make_tiny_model, tmp_path / "model", seed=0, layers=6)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    assert size > 3 << 20  # more than the first and the last MiB
    src = _corpus(tmp_path / "in.jsonl", 8)

    def spec(run: str, **cache: Any) -> PipelineSpec:
        return _spec(tmp_path, run, src, engine={"kind": "transformers", "model": str(model), "device": "cpu", "num_threads": 1},
                     infer={"template": "Q: {prompt}\nA:", "sampling": {"max_tokens": 6, "min_tokens": 6, "temperature": 0}},
                     judge={"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 1}},
                     shard_records=8, chunk_size=8, max_rounds=1, cache=cache)

    def texts(run: str) -> dict[str, str]:
        return {rid: row["result"] for rid, row in _results(spec(run)).items()}

    first = await run_pipeline(spec("a"))
    again = await run_pipeline(spec("b"))
    assert first.approved == again.approved == 8 and (again.result_cache_hits, again.result_cache_lookups) == (8, 8)
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle - (128 << 10):middle + (128 << 10)] = b"\x3f" * (256 << 10)  # a middle layer's weights, retrained
    weights.write_bytes(bytes(data))
    assert weights.stat().st_size == size
    edited = await run_pipeline(spec("c"))
    assert (edited.result_cache_hits, edited.engine_requests, edited.approved) == (0, 8, 8)
    off = await run_pipeline(spec("d", enabled=False))
    assert off.result_cache_lookups == 0 and off.engine_requests == 8
    assert texts("c") == texts("d") != texts("a")  # the edited model's answers, computed


async def test_an_adapter_file_change_never_hits(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"a" * 100)
    src = _corpus(tmp_path / "in.jsonl", 30)
    engine = {"simulated": {"approval_rate": 1.0, "latency_a_s": 0.0002, "latency_b_s": 0.0, "lora": {"adapters": {"tuned": str(adapter)}}}}
    infer = {"template": "Answer: {prompt}", "adapter": "tuned", "sampling": {"max_tokens": 8, "seed": 7}}
    await run_pipeline(_spec(tmp_path, "a", src, engine=engine, infer=infer))
    assert (await run_pipeline(_spec(tmp_path, "b", src, engine=engine, infer=infer))).result_cache_hits == 60
    (adapter / "adapter_model.safetensors").write_bytes(b"b" * 100)
    assert (await run_pipeline(_spec(tmp_path, "c", src, engine=engine, infer=infer))).result_cache_hits == 0


async def test_sampled_requests_without_a_seed_are_never_kept(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "in.jsonl", 40)
    infer = {"template": "Answer: {prompt}", "sampling": {"max_tokens": 8, "temperature": 0.7, "seed": None}}
    judge = {"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 1}}
    await run_pipeline(_spec(tmp_path, "a", src, infer=infer, judge=judge))
    again = await run_pipeline(_spec(tmp_path, "b", src, infer=infer, judge=judge))
    assert again.result_cache_lookups == 0 and again.result_cache_hits == 0 and again.engine_requests == 40
    assert not (tmp_path / "out" / "_result_cache").exists()


async def test_the_judge_verdict_is_cached_under_its_own_key(tmp_path: Path) -> None:
    """New answers (another template) to the same records: inference computes, but a judge
    prompt seen before (the judge template does not show the answer) is answered by the cache."""
    src = _corpus(tmp_path / "in.jsonl", 50)
    judge = {"kind": "llm", "template": "Judge record {id}"}
    await run_pipeline(_spec(tmp_path, "a", src, judge=judge))
    other = {"template": "Reply: {prompt}", "sampling": {"max_tokens": 8, "seed": 7}}
    again = await run_pipeline(_spec(tmp_path, "b", src, judge=judge, infer=other))
    view = PipelineRun(_spec(tmp_path, "b", src, judge=judge, infer=other)).ledger.view()
    infer, judged = view.rounds[0].phases
    assert (infer.result_cache_hits, infer.engine_requests) == (0, 50)
    assert (judged.result_cache_hits, judged.engine_requests) == (50, 0)
    assert again.conservation["ok"]


async def test_off_per_spec(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "in.jsonl", 40)
    await run_pipeline(_spec(tmp_path, "a", src))
    off = await run_pipeline(_spec(tmp_path, "b", src, cache={"enabled": False}))
    assert off.result_cache_lookups == 0 and off.engine_requests == 80 and off.result_cache == {}


def _stored(store: Path) -> dict[str, tuple[bytes, float]]:
    """The local store's entries: key -> (blob, last use)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(store / "entries.sqlite3")) as conn:
        return {k: (b, u) for k, b, u in conn.execute("SELECT key, blob, used FROM entries")}


async def test_the_store_is_bounded(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "in.jsonl", 100)
    summary = await run_pipeline(_spec(tmp_path, "a", src, cache={"max_bytes": 1 << 20}))
    assert summary.result_cache["evicted"] == 0 and summary.result_cache["bytes"] <= 1 << 20
    store = tmp_path / "out" / "_result_cache"
    stored = _stored(store)
    size = sum(len(blob) for blob, _ in stored.values())
    assert len(stored) == summary.result_cache["entries"] == 200 and summary.result_cache["bytes"] == size
    assert list(store.iterdir()) and not list(store.rglob("*.json"))  # one database, no file per entry
    from batch_inference.pool.result_cache import ResultCache

    cache = ResultCache(str(store))
    used = sorted(stored, key=lambda k: stored[k][1])
    cache.get_many_sync(used[:10])  # the 10 least recently used are used now: kept
    report = cache.trim(size // 2)
    assert report.bytes <= size // 2 and report.evicted > 0 and report.entries + report.evicted == 200
    left = _stored(store)
    assert len(left) == report.entries and set(used[:10]) <= set(left) and sum(len(b) for b, _ in left.values()) == report.bytes
    assert cache.trim(size // 2).evicted == 0  # bounded already


async def test_a_store_an_earlier_version_wrote_is_read_and_moved_into_the_database(tmp_path: Path) -> None:
    """An earlier version kept a file per entry (``<k[:2]>/<k[2:4]>/<k>.json``) and left
    ``.<key>.json.<pid>.<ns>.tmp`` where a writer was killed before its rename. After the
    upgrade a lookup reads those files (moving what it finds into the database), and the
    first trim moves the rest and deletes the dead writers' temporaries, not a live one's."""
    import os
    import time

    from batch_inference.pool.result_cache import ResultCache

    src = _corpus(tmp_path / "in.jsonl", 30)
    first = await run_pipeline(_spec(tmp_path, "a", src))
    store = tmp_path / "out" / "_result_cache"
    stored = _stored(store)
    assert first.result_cache["entries"] == len(stored) == 60
    (store / "entries.sqlite3").unlink()  # the same entries, as the earlier version laid them out
    for name in ("entries.sqlite3-wal", "entries.sqlite3-shm"):
        (store / name).unlink(missing_ok=True)
    files = {}
    for key, (blob, _) in stored.items():
        files[key] = store / key[:2] / key[2:4] / f"{key}.json"
        files[key].parent.mkdir(parents=True, exist_ok=True)
        files[key].write_bytes(blob)
        os.utime(files[key], (time.time() - 60, time.time() - 60))
    keys = sorted(files)
    dead = []
    for i, key in enumerate(keys[:5]):
        tmp = files[key].parent / f".{key}.json.{40000 + i}.{123456789 + i}.tmp"
        tmp.write_bytes(b'{"key": "0123456')
        os.utime(tmp, (time.time() - 2 * 3600, time.time() - 2 * 3600))
        dead.append(tmp)
    live = files[keys[5]].parent / f".{keys[5]}.json.{os.getpid()}.{time.monotonic_ns()}.tmp"
    live.write_bytes(b'{"key": "')  # a writer still writing: seconds old

    found = ResultCache(str(store)).get_many_sync(keys[:3])  # a lookup before any trim
    assert sorted(found) == keys[:3] and all(c.from_cache for c in found.values())
    assert not any(files[k].exists() for k in keys[:3]) and set(_stored(store)) == set(keys[:3])

    again = await run_pipeline(_spec(tmp_path, "b", src))  # every request answered; its end trims
    assert (again.result_cache_hits, again.engine_requests) == (60, 0)
    assert again.result_cache["leaked_temporaries"] == 5 and again.result_cache["leaked_temporary_bytes"] == 5 * 16
    assert again.result_cache["entries"] == 60 and again.result_cache["evicted"] == 0
    assert not any(t.exists() for t in dead) and live.exists() and not list(store.rglob("*.json"))
    assert {k: b for k, (b, _) in _stored(store).items()} == {k: b for k, (b, _) in stored.items()}
    assert "5 leaked temporary file(s) removed" in "\n".join(run_lines(PipelineRun(_spec(tmp_path, "b", src)).ledger.view()))
    report = ResultCache(str(store)).trim(1 << 30, temp_grace_s=0.0)  # past its grace, the last one goes too
    assert (report.leaked_temporaries, report.entries) == (1, 60) and not live.exists()
    assert [p.name for p in store.iterdir() if p.is_dir()] == []


async def test_on_s3_a_rerun_hits_and_the_store_is_trimmed(tmp_path: Path, s3_store: Any, s3_store_bucket: str) -> None:
    """The same store on an object store: one bulk lookup per chunk, entries as objects, the trim by listing."""
    from batch_inference.pool.result_cache import ResultCache
    from batch_inference.storage import JsonlFile

    src = f"{s3_store_bucket}/input/data.jsonl"
    with JsonlFile(src, storage_options=s3_store.storage_options).writer_sync() as w:
        w.write_many({"id": f"s{i:03d}", "prompt": f"question {i}"} for i in range(40))

    def spec(run: str, **cache: Any) -> PipelineSpec:
        return PipelineSpec.parse(spec_dict(tmp_path, run=run, input=src, output=f"{s3_store_bucket}/runs", approval=1.0,
                                            storage_options=s3_store.storage_options, cache=cache,
                                            pool={"launcher": "inprocess", "concurrency": 2, "retries": 0}))

    first = await run_pipeline(spec("a"))
    assert first.conservation["ok"] and first.result_cache["entries"] == 80
    again = await run_pipeline(spec("b"))
    assert again.conservation["ok"] and (again.result_cache_hits, again.engine_requests) == (80, 0)
    store = ResultCache(f"{s3_store_bucket}/runs/_result_cache", s3_store.storage_options)
    report = store.trim(again.result_cache["bytes"] // 2)
    assert report.evicted > 0 and report.bytes <= again.result_cache["bytes"] // 2
    third = await run_pipeline(spec("c"))
    assert third.result_cache_hits == report.entries and third.engine_requests == 80 - report.entries


async def test_a_damaged_or_unwritable_store_costs_reuse_never_records(tmp_path: Path) -> None:
    import sqlite3

    src = _corpus(tmp_path / "in.jsonl", 40)
    await run_pipeline(_spec(tmp_path, "a", src))
    store = tmp_path / "out" / "_result_cache"
    keys = sorted(_stored(store))
    with contextlib.closing(sqlite3.connect(store / "entries.sqlite3")) as conn, conn:
        for i, key in enumerate(keys):  # torn, foreign, another key's entry
            blob = b'{"key": "nope", "text": "x"' if i % 2 else _stored(store)[keys[0]][0] if i else b"\x00\xff"
            conn.execute("UPDATE entries SET blob = ? WHERE key = ?", (blob, key))
    damaged = await run_pipeline(_spec(tmp_path, "b", src))
    assert damaged.conservation["ok"] and damaged.result_cache_hits <= 1 and damaged.engine_requests >= 79
    third = await run_pipeline(_spec(tmp_path, "b2", src))  # the damaged run wrote its answers over them
    assert third.result_cache_hits == 80 and third.result_cache["entries"] == 80
    (store / "entries.sqlite3").write_bytes(b"not a database" * 1000)  # the file itself damaged
    for name in ("entries.sqlite3-wal", "entries.sqlite3-shm"):
        (store / name).unlink(missing_ok=True)
    ruined = await run_pipeline(_spec(tmp_path, "b3", src))
    assert ruined.conservation["ok"] and ruined.approved == 40 and ruined.engine_requests == 80
    assert "error" in ruined.result_cache  # the trim could not read it either: said, not raised
    view = PipelineRun(_spec(tmp_path, "b3", src)).ledger.view()
    assert any("result cache lookup" in w and "entries.sqlite3" in w for p in view.rounds[0].phases for w in p.warnings)
    (tmp_path / "blocker").write_text("a file where the store's folder would be")
    blocked = await run_pipeline(_spec(tmp_path, "c", src, cache={"url": str(tmp_path / "blocker" / "cache")}))
    assert blocked.conservation["ok"] and blocked.approved == 40 and blocked.engine_requests == 80
    view = PipelineRun(_spec(tmp_path, "c", src, cache={"url": str(tmp_path / "blocker" / "cache")})).ledger.view()
    assert any("result cache write" in w for p in view.rounds[0].phases for w in p.warnings)


@pytest.mark.parametrize("strategy", ["in_place", "hybrid"])
async def test_the_in_place_tail_reuses_too(tmp_path: Path, strategy: str) -> None:
    """Approval 0.5 (retries at later attempts): the rerun of the same corpus computes nothing,
    every record ends as in the first run, and the approved rows say ``cached``."""
    src = _corpus(tmp_path / "in.jsonl", 60)

    def spec(run: str) -> PipelineSpec:
        return PipelineSpec.parse(spec_dict(tmp_path, run=run, input=str(src), strategy=strategy, approval=0.5,
                                            max_rounds=1, max_attempts=3))

    first = await run_pipeline(spec("a"))
    again = await run_pipeline(spec("b"))
    assert again.conservation["ok"] and again.engine_requests == 0 and again.result_cache_hits == first.engine_requests > 60
    assert (again.approved, again.max_attempts, again.exhausted) == (first.approved, first.max_attempts, first.exhausted)
    rows1, rows2 = _results(spec("a")), _results(spec("b"))
    assert {k: r["result"] for k, r in rows1.items()} == {k: r["result"] for k, r in rows2.items()}
    assert all(r.get("cached") is True for r in rows2.values()) and not any("cached" in r for r in rows1.values())


async def test_the_cache_keys_decide_no_result_so_a_resume_may_change_them(tmp_path: Path) -> None:
    from batch_inference.pipeline.spec import result_changes

    src = _corpus(tmp_path / "in.jsonl", 20)
    on, off = _spec(tmp_path, "a", src), _spec(tmp_path, "a", src, cache={"enabled": False, "max_bytes": 1 << 20})
    assert result_changes(on.public_dict(), off.public_dict()) == []
    first = await run_pipeline(on)
    resumed = await run_pipeline(off)  # the same run, resumed under the edited spec: no SpecChanged
    assert resumed.conservation["ok"] and resumed.approved == first.approved == 20
    with pytest.raises(Exception, match="cache.enabled"):
        PipelineSpec.parse(spec_dict(tmp_path, cache={"enabled": "sometimes"}))
    with pytest.raises(Exception, match="cache.max_byte"):
        PipelineSpec.parse(spec_dict(tmp_path, cache={"max_byte": 5}))


@pytest.mark.slow
async def test_a_cache_outside_the_output_is_a_storage_root_of_the_workers(local_pool: Any, tmp_path: Path) -> None:
    """Worker processes refuse URLs outside their storage roots: a run's default roots hold the
    cache's folder when it is not under the output, and a rerun on those workers hits."""
    import asyncio

    from batch_inference.pipeline.runner import default_roots

    src = _corpus(tmp_path / "in.jsonl", 30)
    elsewhere = tmp_path / "shared-cache"

    def spec(run: str) -> PipelineSpec:
        return _spec(tmp_path, run, src, cache={"url": str(elsewhere)}, output=str(tmp_path / "runs"))

    roots = default_roots(spec("a"))
    assert str(elsewhere) in roots and str(tmp_path / "runs") in roots
    launcher = await asyncio.to_thread(local_pool, engine_config=spec("a").engine.model_dump(), replicas=1, concurrency=2,
                                       storage_roots=roots)
    client = await asyncio.to_thread(launcher.client, retries=0)
    async with client:
        first = await run_pipeline(spec("a"), runner=client)
        again = await run_pipeline(spec("b"), runner=client)
    assert first.quarantined == again.quarantined == 0
    assert (again.result_cache_hits, again.engine_requests) == (60, 0) and (elsewhere / "entries.sqlite3").exists()
