"""ExternalSort: records sorted by a byte key through spill files, stable, in bounded memory."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from batch_inference.storage import JsonlDir
from batch_inference.storage.sort import ExternalSort


def _items(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    keys = [bytes(rng.randrange(4) for _ in range(rng.randrange(0, 4))) for _ in range(n)]  # short keys: many ties, prefixes
    return [(k, orjson.dumps({"i": i, "k": k.hex(), "text": "x\n\"y" * rng.randrange(3)}, option=orjson.OPT_APPEND_NEWLINE))
            for i, k in enumerate(keys)]


@pytest.mark.parametrize(("run_bytes", "fan_in"), [(1 << 30, 32), (2_000, 2), (5_000, 3)])
def test_sorted_by_key_stable_whatever_the_runs(tmp_path: Path, run_bytes: int, fan_in: int) -> None:
    items = _items(600, seed=run_bytes)
    with ExternalSort(str(tmp_path / "spill"), run_bytes=run_bytes, fan_in=fan_in) as s:
        for k, line in items:
            s.add(k, line)
        s.finish()
        got = list(s.iter_sorted())
        again = [line for _, line in s.iter_sorted()]
        runs, levels = s.spilled_runs, s.merge_levels
    assert got == sorted(items, key=lambda kv: kv[0])  # Python's sort is stable: ties in the order added
    assert again == [line for _, line in got]
    if run_bytes < 10_000:
        assert runs > fan_in and levels >= 1  # the small runs really went through spill and merge levels
    else:
        assert runs == 0
    assert not (tmp_path / "spill").exists()  # spill files removed on exit


def test_a_dead_sorts_spill_is_cleared_and_lines_round_trip(tmp_path: Path) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "run-000000.jsonl.zst").write_bytes(b"left by a killed process")
    rec = {"id": "a", "nested": {"k": "}\"{"}, "text": "line\nbreak"}
    with ExternalSort(str(spill), run_bytes=1 << 20) as s:
        assert not spill.exists()
        s.add(b"\x00\xff", orjson.dumps(rec, option=orjson.OPT_APPEND_NEWLINE))
        s.spill()  # force the spill path for one record
        s.finish()
        ((key, line),) = list(s.iter_sorted())
    assert key == b"\x00\xff" and orjson.loads(line) == rec and line.endswith(b"\n")


def test_sorted_lines_feed_a_directory_writer(tmp_path: Path) -> None:
    items = _items(300, seed=3)
    with ExternalSort(str(tmp_path / "spill"), run_bytes=3_000, fan_in=4) as s:
        for k, line in items:
            s.add(k, line)
        with JsonlDir(str(tmp_path / "out")).writer_sync(max_records_per_shard=50, compression="zstd") as w:
            w.write_lines(s.sorted_lines())
    out = list(JsonlDir(str(tmp_path / "out")).iter_records_sync())
    assert [r["i"] for r in out] == [orjson.loads(line)["i"] for _, line in sorted(items, key=lambda kv: kv[0])]
    assert len(JsonlDir(str(tmp_path / "out")).shards()) == 6


def test_add_after_finish_is_refused(tmp_path: Path) -> None:
    s = ExternalSort(str(tmp_path / "spill"))
    s.finish()
    with pytest.raises(RuntimeError):
        s.add(b"k", b"{}\n")
    with pytest.raises(RuntimeError):
        list(ExternalSort(str(tmp_path / "other")).iter_sorted())


def test_parsed_lines_carry_each_records_own_line(tmp_path: Path) -> None:
    from batch_inference.storage import JsonlFile, MalformedRecordError

    recs = [{"id": str(i), "t": "é\n" * i} for i in range(5)]
    with JsonlDir(str(tmp_path / "d")).writer_sync(max_records_per_shard=2, compression="zstd") as w:
        w.write_many(recs)
    got = list(JsonlDir(str(tmp_path / "d")).iter_parsed_lines_sync())
    assert [r for r, _ in got] == recs
    assert all(line == orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) and len(line) == len(bytes(line)) for r, line in got)
    (tmp_path / "f.jsonl").write_bytes(b'{"id": "a"}\n\n{"id": "b"}')  # a blank line, no final newline
    assert [line for _, line in JsonlFile(str(tmp_path / "f.jsonl")).iter_parsed_lines_sync()] == [b'{"id": "a"}\n', b'{"id": "b"}\n']
    (tmp_path / "bad.jsonl").write_bytes(b'{"id": "a"}\n[1]\n')
    with pytest.raises(MalformedRecordError, match=r"bad.jsonl:2: malformed record"):
        list(JsonlFile(str(tmp_path / "bad.jsonl")).iter_parsed_lines_sync())


def test_runs_other_sorts_spilled_and_adopted_in_order_sort_as_one_sort(tmp_path: Path) -> None:
    """The layout pass's workers each sort a part of the input into runs of their own
    (``spill_runs``) in the pass's folder; the pass ``adopt``s them in input order and
    merges: the same records in the same order as one sort given them all (ties too)."""
    items = _items(900, seed=7)
    with ExternalSort(str(tmp_path / "one"), run_bytes=3_000, fan_in=3) as one:
        for k, line in items:
            one.add(k, line)
        one.finish()
        expected = list(one.iter_sorted())
    spill = str(tmp_path / "spill")
    with ExternalSort(spill, run_bytes=3_000, fan_in=3) as merged:
        runs: list[list[str]] = []
        for part in range(3):  # three "workers", each with its own name in the same folder
            w = ExternalSort(spill, run_bytes=2_000, fan_in=3, name=f"w{part}-")
            for k, line in items[part * 300:(part + 1) * 300]:
                w.add(k, line)
            runs.append(w.spill_runs())
            assert runs[-1] and all(p.rsplit("/", 1)[-1].startswith(f"w{part}-run-") for p in runs[-1])
            with pytest.raises(RuntimeError):
                w.add(b"", b"{}\n")
        for part_runs in runs:
            merged.adopt(part_runs, 300)
        merged.finish()
        assert list(merged.iter_sorted()) == expected and merged.records == 900 and merged.merge_levels >= 1
    assert not (tmp_path / "spill").exists()  # the adopting sort removes the workers' runs too


def test_adopt_refuses_runs_elsewhere_and_after_add(tmp_path: Path) -> None:
    with ExternalSort(str(tmp_path / "a")) as s:
        with pytest.raises(ValueError, match="not a run"):
            s.adopt([str(tmp_path / "b" / "run-000000.jsonl.zst")])
        s.add(b"k", b"{}\n")
        with pytest.raises(RuntimeError, match="order of equal keys"):
            s.adopt([])


def _merge_levels_side_by_side(tmp_path: Path, pool: object) -> None:
    items = _items(900, seed=11)
    with ExternalSort(str(tmp_path / "serial"), run_bytes=1_500, fan_in=2) as one:
        for k, line in items:
            one.add(k, line)
        one.finish()
        expected, levels = list(one.iter_sorted()), one.merge_levels
    with ExternalSort(str(tmp_path / "pooled"), run_bytes=1_500, fan_in=2) as s:
        for k, line in items:
            s.add(k, line)
        s.finish(pool)  # type: ignore[arg-type]
        assert list(s.iter_sorted()) == expected and s.merge_levels == levels >= 3
        assert len(list((tmp_path / "pooled").iterdir())) <= 2  # every merged group's runs removed
    assert expected == sorted(items, key=lambda kv: kv[0])


def test_a_pool_merges_each_levels_groups_with_the_same_result(tmp_path: Path) -> None:
    """``finish(pool)``: the layout pass's workers merge a level's groups side by side; the
    runs, their order and the result are the serial merge's."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        _merge_levels_side_by_side(tmp_path, pool)


@pytest.mark.process
def test_worker_processes_merge_each_levels_groups_with_the_same_result(tmp_path: Path) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        _merge_levels_side_by_side(tmp_path, pool)
