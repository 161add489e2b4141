from __future__ import annotations

import orjson
from click.testing import CliRunner

from batch_inference.cli.storage_cmds import inspect, shard
from batch_inference.storage import JsonlDir, JsonlFile, reshard
from batch_inference.storage.reshard import _Bloom, _SeenIds


def write_source(path, n: int, dup_every: int = 0) -> None:
    with open(path, "wb") as f:
        for i in range(n):
            rec = {"text": f"row {i}"}
            if dup_every and i % dup_every == 0:
                rec["id"] = "dup"
            f.write(orjson.dumps(rec) + b"\n")


def test_cli_shard_assigns_ids_reports_duplicates_and_inspect(tmp_path) -> None:
    src = tmp_path / "in.jsonl"
    write_source(src, 2500, dup_every=1000)  # rows 0, 1000, 2000 carry id "dup"
    runner = CliRunner()
    res = runner.invoke(shard, [str(src), str(tmp_path / "out"), "--records-per-shard", "1000"])
    assert res.exit_code == 0, res.output
    assert "2,500 records in 3 shards" in res.output and "duplicate ids" in res.output and "'dup' x3" in res.output
    out = list(JsonlDir(str(tmp_path / "out")).iter_records_sync())
    assert out[1] == {"text": "row 1", "id": "000000000001"} and out[1000]["id"] == "dup"

    res = runner.invoke(inspect, [str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "shards: 3" in res.output and "records: 2,500" in res.output and "zstd" in res.output
    res = runner.invoke(inspect, [str(src)])
    assert res.exit_code == 0 and "records: 2,500" in res.output and "none" in res.output
    res = runner.invoke(inspect, [str(tmp_path / "missing")])
    assert res.exit_code != 0 and "missing" in res.output


def test_cli_shard_plain_from_zst_and_byte_limit(tmp_path) -> None:
    with JsonlFile(str(tmp_path / "in.jsonl.zst")).writer_sync() as w:
        w.write_many({"id": f"x{i}", "pad": "p" * 80} for i in range(300))
    res = CliRunner().invoke(
        shard,
        [str(tmp_path / "in.jsonl.zst"), str(tmp_path / "out"), "-n", "1000", "--max-bytes-per-shard", "10000", "--compression", "none"],
    )
    assert res.exit_code == 0, res.output
    d = JsonlDir(str(tmp_path / "out"))
    assert all(s.name.endswith(".jsonl") for s in d.shards()) and len(d.shards()) > 1
    assert all(s["bytes"] <= 10_000 for s in d.manifest().shards)
    assert [r["id"] for r in d.iter_records_sync()] == [f"x{i}" for i in range(300)]


def test_reshard_from_a_dir_and_duplicates_are_exact(tmp_path) -> None:
    with JsonlDir(str(tmp_path / "a")).writer_sync(max_records_per_shard=7) as w:
        w.write_many({"id": f"r{i % 40}"} for i in range(50))  # r0..r9 appear twice
    rep = reshard(str(tmp_path / "a"), str(tmp_path / "b"), records_per_shard=20)  # exact: a set of the ids
    assert (rep.records, rep.shards, rep.ids_assigned) == (50, 3, 0)
    assert rep.duplicate_ids == {f"r{i}": 2 for i in range(10)}
    # the Bloom filter from the 6th id on (tiny: many false suspects), the set's ids moved into it
    rep = reshard(str(tmp_path / "a"), str(tmp_path / "c"), records_per_shard=20, bloom_bytes=8, exact_ids=5)
    assert rep.duplicate_ids == {f"r{i}": 2 for i in range(10)}


def test_seen_ids_are_exact_while_small_then_a_bloom_filter_that_keeps_them() -> None:
    seen = _SeenIds(1024, exact=3)
    assert [seen.add(k) for k in ("a", "b", "a", "c")] == [False, False, True, False]
    assert seen.bloom is None  # 3 ids: no filter allocated
    assert not seen.add("d") and seen.bloom is not None and seen.ids is None
    assert all(seen.add(k) for k in ("a", "b", "c", "d"))  # the set's members are in the filter


def test_bloom_reports_seen_ids() -> None:
    b = _Bloom(1024)
    assert not b.add("a") and b.add("a") and not b.add("b")
