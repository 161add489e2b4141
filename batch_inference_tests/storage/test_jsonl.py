from __future__ import annotations

import asyncio
import os
import random
import tracemalloc
from pathlib import Path

import orjson
import pytest
import zstandard

from batch_inference.storage import (
    ConcurrentWriteError,
    CorruptShardError,
    JsonlDir,
    JsonlFile,
    MalformedRecordError,
)
from batch_inference.storage import _io, directory, file, urls
from batch_inference.storage import lock as dir_lock


def recs(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"{i:012d}", "text": f"sample {i}", "n": i} for i in range(start, start + n)]


async def write_file(url: str, records: list[dict]) -> None:
    async with JsonlFile(url).writer() as w:
        await w.write_many(records)


def put_bytes(url: str, data: bytes) -> None:
    fs, path = urls.fs_for(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
async def test_file_round_trip_sync_and_async(base_url: str, suffix: str) -> None:
    url = urls.join(base_url, "a" + suffix)
    data = recs(5000)
    await write_file(url, data)
    f = JsonlFile(url)
    assert f.compressed is (suffix == ".jsonl.zst")
    assert [r async for r in f.iter_records()] == data
    assert list(f.iter_records_sync()) == data
    assert await f.exists() and f.exists_sync()


async def test_zstd_is_real_zstd_and_plain_is_plain(tmp_path) -> None:
    await write_file(str(tmp_path / "a.jsonl.zst"), recs(100))
    await write_file(str(tmp_path / "a.jsonl"), recs(100))
    raw = (tmp_path / "a.jsonl.zst").read_bytes()
    assert raw[:4] == b"\x28\xb5\x2f\xfd"
    plain = zstandard.ZstdDecompressor().stream_reader(raw).read()
    assert plain == (tmp_path / "a.jsonl").read_bytes()
    assert [orjson.loads(x) for x in plain.splitlines()] == recs(100)


async def test_reads_foreign_multi_frame_zstd_and_crlf(tmp_path) -> None:
    c = zstandard.ZstdCompressor()
    body = c.compress(b'{"a": 1}\r\n\n{"a": 2}\n') + c.compress(b'{"a": 3}')  # no final newline
    put_bytes(str(tmp_path / "f.jsonl.zst"), body)
    assert list(JsonlFile(str(tmp_path / "f.jsonl.zst")).iter_records_sync()) == [{"a": 1}, {"a": 2}, {"a": 3}]


@pytest.mark.slow
async def test_bounded_memory_independent_of_shard_size(tmp_path) -> None:
    """Reading a shard ~40x the read chunk keeps traced memory at a few chunks, whatever the size."""
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghij", k=6)) for _ in range(500)]

    def write(path: str, n: int) -> None:
        with JsonlFile(path).writer_sync() as w:
            w.write_many({"id": i, "t": " ".join(rng.choices(words, k=25))} for i in range(n))

    def peak(path: str) -> int:
        tracemalloc.start()
        try:
            count = sum(1 for _ in JsonlFile(path).iter_records_sync())
            return tracemalloc.get_traced_memory()[1], count
        finally:
            tracemalloc.stop()

    for suffix in (".jsonl", ".jsonl.zst"):
        small, big = str(tmp_path / f"s{suffix}"), str(tmp_path / f"b{suffix}")
        write(small, 20_000)
        write(big, 240_000)
        p_small, n_small = peak(small)
        p_big, n_big = peak(big)
        assert (n_small, n_big) == (20_000, 240_000)
        raw_big = os.path.getsize(big) if suffix == ".jsonl" else 240_000 * 180  # ~43 MB uncompressed
        assert raw_big > 40 * _io.PLAIN_READ_SIZE
        assert p_big < 8 * 2**20, f"{suffix}: peak {p_big} bytes for a {raw_big} byte shard"
        assert p_big < 1.5 * p_small + 2**20, f"{suffix}: memory grew with shard size ({p_small} -> {p_big})"


async def test_async_iteration_hops_per_chunk_not_per_record(tmp_path, monkeypatch) -> None:
    url = str(tmp_path / "a.jsonl.zst")
    await write_file(url, recs(20_000))
    hops = 0
    real = asyncio.to_thread

    async def counting(fn, *a, **k):
        nonlocal hops
        hops += 1
        return await real(fn, *a, **k)

    monkeypatch.setattr(file.asyncio, "to_thread", counting)
    n = 0
    async for _ in JsonlFile(url).iter_records():
        n += 1
    assert n == 20_000
    assert hops < 20, hops  # a handful of chunks, not 20,000 hops


async def test_early_break_closes_cleanly(tmp_path) -> None:
    url = str(tmp_path / "a.jsonl.zst")
    await write_file(url, recs(10_000))
    it = JsonlFile(url).iter_records()
    async for r in it:
        assert r["n"] == 0
        break
    await it.aclose()


# ---------------------------------------------------------------- errors


async def test_missing_file_and_dir_name_the_url(base_url: str) -> None:
    f = JsonlFile(urls.join(base_url, "nope.jsonl.zst"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl.zst"):
        list(f.iter_records_sync())
    with pytest.raises(FileNotFoundError, match="nope.jsonl.zst"):
        [r async for r in f.iter_records()]
    with pytest.raises(FileNotFoundError, match="missing-dir"):
        JsonlDir(urls.join(base_url, "missing-dir")).shards()


async def test_empty_dir_iterates_nothing(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    d = JsonlDir(str(tmp_path / "empty"))
    assert d.shards() == [] and list(d.iter_records_sync()) == []
    assert [r async for r in d.iter_records()] == []
    async with JsonlDir(str(tmp_path / "written-empty")).writer() as w:
        pass
    assert JsonlDir(str(tmp_path / "written-empty")).count_records() == 0 and w.records == 0


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.zst"])
async def test_malformed_line_names_file_and_line(tmp_path, suffix: str) -> None:
    body = b'{"a": 1}\n{"a": 2}\n{"a": oops}\n{"a": 4}\n'
    url = str(tmp_path / f"bad{suffix}")
    put_bytes(url, zstandard.ZstdCompressor().compress(body) if suffix.endswith("zst") else body)
    with pytest.raises(MalformedRecordError) as ei:
        list(JsonlFile(url).iter_records_sync())
    assert ei.value.line == 3 and ei.value.url == url and f"bad{suffix}:3" in str(ei.value)
    with pytest.raises(MalformedRecordError, match=":3: malformed"):
        [r async for r in JsonlFile(url).iter_records()]


async def test_line_numbers_stay_exact_across_chunks(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_io, "PLAIN_READ_SIZE", 100)  # many chunk boundaries, lines split across them
    lines = [orjson.dumps({"i": i, "pad": "x" * (i % 37)}) for i in range(500)]
    lines[411] = b'{"i": 411, "broken": '
    put_bytes(str(tmp_path / "a.jsonl"), b"\n".join(lines) + b"\n")
    with pytest.raises(MalformedRecordError) as ei:
        list(JsonlFile(str(tmp_path / "a.jsonl")).iter_records_sync())
    assert ei.value.line == 412


async def test_non_utf8_and_non_object_lines(tmp_path) -> None:
    put_bytes(str(tmp_path / "u.jsonl"), b'{"a": 1}\n{"a": "\xff\xfe"}\n')
    with pytest.raises(MalformedRecordError, match=r"u\.jsonl:2: .*UTF-8"):
        list(JsonlFile(str(tmp_path / "u.jsonl")).iter_records_sync())
    put_bytes(str(tmp_path / "o.jsonl"), b'{"a": 1}\n[1, 2]\n')
    with pytest.raises(MalformedRecordError, match=r"o\.jsonl:2: .*JSON object"):
        list(JsonlFile(str(tmp_path / "o.jsonl")).iter_records_sync())


async def test_quarantine_sink_sync_and_async(tmp_path) -> None:
    url = str(tmp_path / "q.jsonl")
    put_bytes(url, b'{"a": 1}\nnot json\n\n{"a": 3}\n"str"\n{"a": 6}\n')
    got: list[dict] = []
    good = list(JsonlFile(url).iter_records_sync(on_error="quarantine", quarantine=got.append))
    assert good == [{"a": 1}, {"a": 3}, {"a": 6}]
    assert [(q["file"], q["line"], q["raw"]) for q in got] == [(url, 2, "not json"), (url, 5, '"str"')]
    assert all(q["reason"] for q in got)

    seen: list[dict] = []

    async def sink(entry: dict) -> None:
        await asyncio.sleep(0)
        seen.append(entry)

    good = [r async for r in JsonlFile(url).iter_records(on_error="quarantine", quarantine=sink)]
    assert good == [{"a": 1}, {"a": 3}, {"a": 6}] and [q["line"] for q in seen] == [2, 5]
    with pytest.raises(ValueError, match="quarantine sink"):
        list(JsonlFile(url).iter_records_sync(on_error="quarantine"))


def test_numbered_records_count_every_line(tmp_path) -> None:
    """``iter_numbered_sync``: each record with its line's 0-based number, blank and bad lines
    counted (the quarantine's 1-based ``line`` is that number + 1); over a dir, the shards in order."""
    url = str(tmp_path / "q.jsonl")
    put_bytes(url, b'{"a": 1}\nnot json\n\n{"a": 3}\n"str"\n{"a": 6}\n')
    got: list[dict] = []
    assert list(JsonlFile(url).iter_numbered_sync(on_error="quarantine", quarantine=got.append)) == [
        (0, {"a": 1}), (3, {"a": 3}), (5, {"a": 6})]
    assert [q["line"] for q in got] == [2, 5]
    with pytest.raises(MalformedRecordError, match=r"q\.jsonl:2: "):
        list(JsonlFile(url).iter_numbered_sync())
    with JsonlDir(str(tmp_path / "d")).writer_sync(max_records_per_shard=2, compression=None) as w:
        w.write_many({"i": i} for i in range(5))
    assert [n for n, _ in JsonlDir(str(tmp_path / "d")).iter_numbered_sync()] == [0, 1, 2, 3, 4]


async def test_corrupt_and_truncated_zstd_name_the_shard(tmp_path) -> None:
    put_bytes(str(tmp_path / "garbage.jsonl.zst"), b"this is not zstd at all" * 10)
    with pytest.raises(CorruptShardError, match="garbage.jsonl.zst"):
        list(JsonlFile(str(tmp_path / "garbage.jsonl.zst")).iter_records_sync())
    await write_file(str(tmp_path / "ok.jsonl.zst"), recs(20_000))
    whole = (tmp_path / "ok.jsonl.zst").read_bytes()
    put_bytes(str(tmp_path / "cut.jsonl.zst"), whole[: len(whole) // 2])
    with pytest.raises(CorruptShardError, match="cut.jsonl.zst.*truncated"):
        [r async for r in JsonlFile(str(tmp_path / "cut.jsonl.zst")).iter_records()]
    flipped = bytearray(whole)
    flipped[len(whole) // 2] ^= 0xFF
    put_bytes(str(tmp_path / "flip.jsonl.zst"), bytes(flipped))
    with pytest.raises((CorruptShardError, MalformedRecordError)):
        list(JsonlFile(str(tmp_path / "flip.jsonl.zst")).iter_records_sync())


# ---------------------------------------------------------------- atomic writes


async def test_file_invisible_until_commit_and_discarded_on_error(base_url: str) -> None:
    url = urls.join(base_url, "a.jsonl.zst")
    f = JsonlFile(url)
    with pytest.raises(RuntimeError, match="boom"):
        async with f.writer() as w:
            await w.write_many(recs(30_000))  # > one write buffer: bytes really hit storage
            await asyncio.sleep(0.05)
            assert not f.exists_sync()
            raise RuntimeError("boom")
    assert not f.exists_sync()
    assert not [p for p in f.fs.find(f.path.rsplit("/", 1)[0]) if ".tmp-" in p]


async def test_rewrite_replaces_whole(base_url: str) -> None:
    url = urls.join(base_url, "a.jsonl")
    await write_file(url, recs(1000))
    await write_file(url, recs(3, start=7))
    assert await JsonlFile(url).read_all() == recs(3, start=7)


async def test_concurrent_rewrite_of_one_shard_keeps_one_whole_version(base_url: str) -> None:
    url = urls.join(base_url, "shard.jsonl.zst")
    a, b = recs(30_000), recs(25_000, start=100_000)

    async def slow_write(data: list[dict]) -> None:
        async with JsonlFile(url).writer() as w:
            for i in range(0, len(data), 1000):
                await w.write_many(data[i : i + 1000])
                await asyncio.sleep(0)  # interleave the two writers

    await asyncio.gather(slow_write(a), slow_write(b), asyncio.to_thread(lambda: None))
    got = list(JsonlFile(url).iter_records_sync())
    assert got in (a, b)


# ---------------------------------------------------------------- JsonlDir


async def test_rotation_at_records(base_url: str) -> None:
    d = JsonlDir(urls.join(base_url, "d"))
    async with d.writer(max_records_per_shard=1000, compression="zstd") as w:
        for r in recs(2500):
            await w.write(r)
        assert w.records == 2500
    assert w.shards_written == 3
    assert [s.name for s in d.shards()] == ["part-00000.jsonl.zst", "part-00001.jsonl.zst", "part-00002.jsonl.zst"]
    assert [s["records"] for s in d.manifest().shards] == [1000, 1000, 500]
    assert d.count_records() == 2500
    assert [r["n"] for r in d.iter_records_sync()] == list(range(2500))
    assert [r["n"] async for r in d.iter_records()] == list(range(2500))


async def test_dir_writer_defaults_to_plain_jsonl_as_the_reference_does(tmp_path) -> None:
    """Code ported from flyteplugins.jsonl writes ``part-*.jsonl`` without saying so."""
    d = JsonlDir(str(tmp_path / "plain"))
    async with d.writer(max_records_per_shard=2) as w:
        await w.write_many(recs(3))
    with JsonlDir(str(tmp_path / "plain-sync")).writer_sync() as sw:
        sw.write_many(recs(1))
    assert [s.name for s in d.shards()] == ["part-00000.jsonl", "part-00001.jsonl"]
    assert d.manifest().compression is None and not d.shards()[0].compressed
    assert [s.name for s in JsonlDir(str(tmp_path / "plain-sync")).shards()] == ["part-00000.jsonl"]


async def test_rotation_at_bytes_and_oversized_record(base_url: str) -> None:
    d = JsonlDir(urls.join(base_url, "d"))
    line = len(orjson.dumps({"k": "x" * 90})) + 1  # 101 bytes per record
    data = [{"k": "x" * 90} for _ in range(25)]
    data.insert(10, {"k": "y" * 2000})  # larger than the limit: a shard alone
    async with d.writer(max_bytes_per_shard=5 * line, compression=None) as w:
        await w.write_many(data)
    man = d.manifest()
    assert [s["records"] for s in man.shards] == [5, 5, 1, 5, 5, 5]
    assert all(s["bytes"] <= 5 * line for i, s in enumerate(man.shards) if i != 2)
    assert man.compression is None and [s.name for s in d.shards()][0] == "part-00000.jsonl"
    assert list(d.iter_records_sync()) == data


async def test_rotation_bulk_path_matches_line_by_line(tmp_path) -> None:
    """Bulk slices and the per-line path agree on every boundary."""
    data = [{"i": i, "t": "z" * (i % 13)} for i in range(10_000)]
    d = JsonlDir(str(tmp_path / "d"))
    with d.writer_sync(max_records_per_shard=777, max_bytes_per_shard=20_000, compression=None) as w:
        w.write_many(data)
    man = d.manifest()
    expect, cur_n, cur_b = [], 0, 0
    for r in data:
        n = len(orjson.dumps(r)) + 1
        if cur_n and (cur_n >= 777 or cur_b + n > 20_000):
            expect.append(cur_n)
            cur_n = cur_b = 0
        cur_n += 1
        cur_b += n
    expect.append(cur_n)
    assert [s["records"] for s in man.shards] == expect
    assert list(d.iter_records_sync()) == data


@pytest.mark.slow
async def test_sorted_write_order_past_ten_thousand_shards(tmp_path) -> None:
    """12,000 real shards list back in write order, with and without the manifest."""
    d = JsonlDir(str(tmp_path / "many"))
    n = 12_000
    with d.writer_sync(max_records_per_shard=1, compression=None) as w:
        w.write_many({"i": i} for i in range(n))
    assert len(d.shards()) == n
    d.fs.rm(f"{d.path}/{directory.MANIFEST_NAME}")  # force the listing path
    names = [s.name for s in d.shards()]
    assert names[0] == "part-00000.jsonl" and names[-1] == f"part-{n - 1:05d}.jsonl"
    assert [r["i"] for r in d.iter_records_sync()] == list(range(n))


def test_names_sort_in_write_order_across_digit_widths() -> None:
    d = JsonlDir("memory://x")
    indices = [0, 9, 10, 99, 9_999, 10_000, 99_999, 100_000, 123_456, 1_000_000]
    names = [urls.basename(d.shard_url(i)) for i in indices]
    assert names[6:8] == ["part-99999.jsonl.zst", "part-100000.jsonl.zst"]
    shuffled = names[:]
    random.Random(1).shuffle(shuffled)
    assert sorted(shuffled, key=directory.natural_key) == names


async def test_dir_rewrite_drops_old_shards_and_failed_write_leaves_nothing(base_url: str) -> None:
    d = JsonlDir(urls.join(base_url, "d"))
    async with d.writer(max_records_per_shard=10) as w:
        await w.write_many(recs(50))
    assert len(d.shards()) == 5
    async with d.writer(max_records_per_shard=10) as w:
        await w.write_many(recs(15, start=1000))
    assert [s.name for s in d.shards()] == ["part-00000.jsonl", "part-00001.jsonl"]
    d.fs.rm(f"{d.path}/{directory.MANIFEST_NAME}")
    assert len(d.shards()) == 2  # the old part-00002..4 are gone from storage, not just the manifest
    with pytest.raises(ValueError, match="bad"):
        async with d.writer(max_records_per_shard=10) as w:
            await w.write_many(recs(35))
            raise ValueError("bad")
    assert d.shards() == [] and d.manifest() is None


async def test_concurrent_dir_writers_get_a_clear_error(base_url: str) -> None:
    d = JsonlDir(urls.join(base_url, "d"))
    async with d.writer() as w1:
        await w1.write_many(recs(10))
        with pytest.raises(ConcurrentWriteError, match="being written"):
            async with d.writer() as w2:
                await w2.write_many(recs(5))
        await w1.write_many(recs(10, start=10))
    assert [r["n"] for r in d.iter_records_sync()] == list(range(20))


@pytest.mark.process
async def test_stale_lock_of_dead_writer_is_taken_over(tmp_path) -> None:
    import socket
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    d = JsonlDir(str(tmp_path / "d"))
    put_bytes(
        f"{d.url}/{dir_lock.LOCK_NAME}",
        orjson.dumps({"token": "old", "host": socket.gethostname(), "pid": dead_pid, "heartbeat": 1e18}),
    )
    async with d.writer() as w:
        await w.write_many(recs(3))
    assert d.count_records() == 3 and not os.path.exists(f"{d.url}/{dir_lock.LOCK_NAME}")



async def test_writer_that_lost_its_lock_fails_loudly_and_touches_nothing(tmp_path) -> None:
    d = JsonlDir(str(tmp_path / "d"))
    lock = tmp_path / "d" / dir_lock.LOCK_NAME
    with pytest.raises(ConcurrentWriteError, match="lost the directory lock"):
        async with d.writer(max_records_per_shard=5) as w:
            await w.write_many(recs(12))
            # another writer judged us dead and took over (its lock, its shard)
            lock.write_bytes(orjson.dumps({"token": "other", "host": "elsewhere", "pid": 1, "heartbeat": 1e18}))
    assert lock.exists() and d.manifest() is None
    assert len(d.shards()) == 3  # nothing deleted under the new holder's feet


async def test_dir_lock_heartbeat_is_refreshed_while_writing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dir_lock, "LOCK_TTL_S", 0.0)  # refresh on every block
    d = JsonlDir(str(tmp_path / "d"))
    lock = tmp_path / "d" / dir_lock.LOCK_NAME
    async with d.writer() as w:
        await w.write_many(recs(100))
        first = orjson.loads(lock.read_bytes())["heartbeat"]
        await asyncio.sleep(0.01)
        await w.write_many(recs(40_000))  # several blocks
        assert orjson.loads(lock.read_bytes())["heartbeat"] > first
    assert not lock.exists()


async def test_a_reader_cancelled_mid_read_raises_cancelled_not_a_generator_error(tmp_path, monkeypatch) -> None:
    """Ctrl-C while the reading thread is inside a chunk: the reader ends with CancelledError
    (seen before as ``ValueError: generator already executing`` from closing it under the thread)."""
    import time as _time

    url = str(tmp_path / "slow.jsonl")
    await write_file(url, recs(10))
    real = file._shard_blocks

    def slow(list_shards):
        for item in real(list_shards):
            _time.sleep(0.3)  # the thread is busy in next() when the cancel lands
            yield item

    monkeypatch.setattr(file, "_shard_blocks", slow)

    async def consume() -> list[dict]:
        return [r async for r in JsonlFile(url).iter_records()]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_directory_writer_cuts_a_shard_where_told_and_still_rotates_at_its_limit(tmp_path: Path) -> None:
    d = JsonlDir(str(tmp_path / "d"))
    with d.writer_sync(max_records_per_shard=5) as w:
        w.write_many({"i": i} for i in range(3))
        w.cut()
        w.cut()  # nothing written since: no empty shard
        w.write_many({"i": i} for i in range(3, 10))
        w.cut()
    assert [s["records"] for s in d.manifest().shards] == [3, 5, 2]
    assert [r["i"] for r in d.iter_records_sync()] == list(range(10))
