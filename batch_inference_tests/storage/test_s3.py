"""Storage over HTTP through the real s3fs/aiobotocore stack, against moto and SeaweedFS on 127.0.0.1 (``s3_store``)."""

from __future__ import annotations

import asyncio

import pytest

from batch_inference.storage import CheckpointStore, ConcurrentWriteError, JsonlDir, JsonlFile, reshard


def recs(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"{i:012d}", "n": i, "text": "s3 sample " * 5} for i in range(start, start + n)]


async def test_write_rotate_list_read(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    d = JsonlDir(f"{s3_store_bucket}/run/sharded", storage_options=so)
    async with d.writer(max_records_per_shard=4000) as w:
        for r in recs(10_000):
            await w.write(r)
    assert [s.name for s in d.shards()] == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert d.count_records() == 10_000
    assert [r["n"] async for r in d.iter_records()] == list(range(10_000))
    # a fresh instance (another process's view) lists the same thing without the manifest
    d.fs.rm(f"{d.path}/_manifest.json")
    other = JsonlDir(f"{s3_store_bucket}/run/sharded", storage_options=so)
    assert [s.name for s in other.shards()] == [s.name for s in d.shards()]
    assert sum(1 for _ in other.iter_records_sync()) == 10_000


async def test_rewrite_a_shard_and_discard_on_error(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    f = JsonlFile(f"{s3_store_bucket}/round-00/inferred/part-00003.jsonl.zst", storage_options=so)
    async with f.writer() as w:
        await w.write_many(recs(30_000))  # written in blocks; the object appears only at commit
    async with f.writer() as w:
        await w.write_many(recs(5, start=50))
    assert await f.read_all() == recs(5, start=50)
    with pytest.raises(RuntimeError):
        async with f.writer() as w:
            await w.write_many(recs(40_000, start=7))
            raise RuntimeError("task died")
    assert await f.read_all() == recs(5, start=50)  # the aborted upload never replaced it


async def test_missing_key_and_wrong_credentials(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        [r async for r in JsonlFile(f"{s3_store_bucket}/nope.jsonl", storage_options=so).iter_records()]
    with pytest.raises(FileNotFoundError, match="no-dir"):
        JsonlDir(f"{s3_store_bucket}/no-dir", storage_options=so).shards()
    async with JsonlFile(f"{s3_store_bucket}/ok.jsonl", storage_options=so).writer() as w:
        await w.write({"a": 1})
    bad = {**so, "secret": "not-the-secret"}
    with pytest.raises(PermissionError):
        list(JsonlFile(f"{s3_store_bucket}/ok.jsonl", storage_options=bad).iter_records_sync())
    with pytest.raises(PermissionError):
        async with JsonlFile(f"{s3_store_bucket}/new.jsonl", storage_options=bad).writer() as w:
            await w.write({"a": 1})


async def test_dir_lock_and_checkpoints_on_s3(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    d = JsonlDir(f"{s3_store_bucket}/out", storage_options=so)
    async with d.writer() as w:
        await w.write({"a": 1})
        with pytest.raises(ConcurrentWriteError):
            async with JsonlDir(f"{s3_store_bucket}/out", storage_options=so).writer():
                pass
    store = CheckpointStore(f"{s3_store_bucket}/tail/checkpoints", storage_options=so)
    await asyncio.gather(*(store.append([{"id": f"s{i}", "attempt": a} for i in range(100)]) for a in range(3)))
    await store.append([{"id": "s1", "attempt": 7}])
    state = await store.load()
    assert len(state) == 100 and state["s1"]["attempt"] == 7 and len(store.segments()) == 4


async def test_reshard_s3_to_s3(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    async with JsonlFile(f"{s3_store_bucket}/raw/input.jsonl", storage_options=so).writer() as w:
        await w.write_many({"text": f"t{i}"} for i in range(2500))
    report = await asyncio.to_thread(
        reshard, f"{s3_store_bucket}/raw/input.jsonl", f"{s3_store_bucket}/sharded", records_per_shard=1000, storage_options=so
    )
    assert (report.records, report.shards, report.ids_assigned) == (2500, 3, 2500)
    out = JsonlDir(f"{s3_store_bucket}/sharded", storage_options=so)
    assert [r["id"] for r in out.iter_records_sync()][:2] == ["000000000000", "000000000001"]


async def test_reader_with_a_stale_listing_reads_the_rewritten_shard_whole(s3_store, s3_store_bucket: str) -> None:
    so = s3_store.storage_options
    other_process = {**so, "skip_instance_cache": True}  # its own s3fs instance and caches
    reader = JsonlDir(f"{s3_store_bucket}/d", storage_options=so)
    async with reader.writer() as w:
        await w.write_many(recs(10))
    shard = reader.shards()[0]
    assert shard.fs.ls(reader.path, detail=True)  # the reader's instance now caches the old size
    async with JsonlFile(shard.url, storage_options=other_process).writer() as w:
        await w.write_many(recs(5000, start=1))
    assert shard.exists_sync()
    assert [r["n"] for r in shard.iter_records_sync()] == list(range(1, 5001))


async def test_a_shard_larger_than_a_part_uploads_in_valid_multipart_parts(s3_store, s3_store_bucket: str) -> None:
    # over s3fs' 5 MiB block: a multipart upload, whose parts a real server checks (>= 5 MiB but the last)
    so = s3_store.storage_options
    f = JsonlFile(f"{s3_store_bucket}/big/part-00000.jsonl", storage_options=so)
    rows = [{"id": f"{i:08d}", "text": f"{i:08d}" * 60} for i in range(26_000)]  # ~13 MB uncompressed
    async with f.writer() as w:
        await w.write_many(rows)
    assert f.fs.info(f.path)["size"] > 12 * 2**20
    assert [r["id"] async for r in f.iter_records()] == [r["id"] for r in rows]


@pytest.mark.infra
def test_seaweedfs_keeps_committed_shards_across_a_crash_and_refuses_a_bad_multipart(seaweedfs) -> None:
    """What moto cannot show: the server SIGKILLed and restarted still has our data; its
    multipart rules are real (a small non-final part is refused); wrong keys are refused."""
    import boto3
    import botocore.exceptions

    so = {**seaweedfs.storage_options, "skip_instance_cache": True}
    bucket = seaweedfs.make_bucket()
    d = JsonlDir(f"{bucket}/run/sharded", storage_options=so)
    with d.writer_sync(max_records_per_shard=1000) as w:
        w.write_many(recs(3500))
    names = [s.name for s in d.shards()]
    restart_s = seaweedfs.restart(kill=True)
    again = JsonlDir(f"{bucket}/run/sharded", storage_options={**so})
    assert [s.name for s in again.shards()] == names and len(names) == 4
    assert [r["n"] for r in again.iter_records_sync()] == list(range(3500))
    print(f"SEAWEEDFS crash restart: back with every shard in {restart_s:.1f}s")

    s3 = boto3.client("s3", endpoint_url=seaweedfs.endpoint_url, region_name="us-east-1",
                      aws_access_key_id=seaweedfs.key, aws_secret_access_key=seaweedfs.secret)
    mpu = s3.create_multipart_upload(Bucket=bucket[5:], Key="small-parts")
    parts = [{"PartNumber": n, "ETag": s3.upload_part(Bucket=bucket[5:], Key="small-parts", UploadId=mpu["UploadId"],
                                                      PartNumber=n, Body=b"x" * 1024)["ETag"]} for n in (1, 2)]
    with pytest.raises(botocore.exceptions.ClientError, match="EntityTooSmall"):
        s3.complete_multipart_upload(Bucket=bucket[5:], Key="small-parts", UploadId=mpu["UploadId"],
                                     MultipartUpload={"Parts": parts})
    wrong = boto3.client("s3", endpoint_url=seaweedfs.endpoint_url, region_name="us-east-1",
                         aws_access_key_id=seaweedfs.key, aws_secret_access_key="not-the-secret")
    with pytest.raises(botocore.exceptions.ClientError, match="SignatureDoesNotMatch|AccessDenied|InvalidAccessKeyId"):
        wrong.list_objects_v2(Bucket=bucket[5:])
