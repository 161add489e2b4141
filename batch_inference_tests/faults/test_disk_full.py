"""Disk full while writing shards: a real small tmpfs (ENOSPC from the kernel), and the
same scenario on ``quota://`` (an fsspec filesystem that fails writes past a quota with
ENOSPC) so that it runs where mounting is not allowed too.

Expected: a clear error, no partial shard visible, no shard quarantined for a full disk
(it is not the data's fault), and after space is freed (the tmpfs grown) the same run
resumes and completes with every record conserved.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import run_pipeline
from batch_inference.storage import JsonlFile
from batch_inference.storage.urls import fs_for
from batch_inference_tests.faults.helpers import assert_conserved, make_spec
from batch_inference_tests.faults.quota_fs import QuotaFileSystem


def _mount(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; the reason it cannot be done, or None."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, timeout=30)
    return None if res.returncode == 0 else (res.stderr.decode().strip() or f"mount exited {res.returncode}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1.5 MB tmpfs, unmounted at teardown (needs root or CAP_SYS_ADMIN: skipped without)."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN); this environment is not root")
    why = _mount(mnt, "1536k")
    if why:
        pytest.skip(f"cannot mount a tmpfs here: {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _visible_shards_are_whole(url: str) -> int:
    """Every visible (non-hidden) shard decompresses and parses completely; returns how many."""
    fs, root = fs_for(url)
    fs.invalidate_cache()
    n = 0
    for path in fs.find(root):
        name = path.rsplit("/", 1)[-1]
        if ".jsonl" in name and not name.startswith("."):
            sum(1 for _ in JsonlFile(url + path[len(root):]).iter_records_sync())
            n += 1
    return n


def _input(tmp_path: Path) -> tuple[Path, list[str]]:
    """~1 KB of incompressible text per record: the sharded input (~0.7 MB) fits, round 0 does not."""
    src = tmp_path / "input.jsonl"
    ids = [f"f{i:04d}" for i in range(700)]
    with open(src, "wb") as f:
        for rid in ids:
            f.write(orjson.dumps({"id": rid, "prompt": os.urandom(500).hex()}) + b"\n")
    return src, ids


async def _fill_then_grow(tmp_path: Path, out: str, grow: Any, run: Any = run_pipeline) -> str:
    src, ids = _input(tmp_path)
    spec = make_spec(tmp_path, input=str(src), output=out, shard_records=100, chunk_size=50,
                     engine={"kind": "simulated", "simulated": {"approval_rate": 0.7, "latency_a_s": 0.0, "latency_b_s": 0.0}})
    with pytest.raises(OSError) as info:
        await run(spec, retries=0)
    message = str(info.value)
    assert "No space left on device" in message and out.split("://")[-1] in message, message
    root = f"{out}/{spec.run}"
    assert _visible_shards_are_whole(root) > 0
    fs, path = fs_for(root)
    assert not [p for p in fs.find(path) if "/failed/" in p], "a full disk must not quarantine shards"

    grow()
    summary = await run(spec)
    assert summary.failed == 0 and summary.conservation["ok"]
    assert_conserved(spec, ids)
    return message


@pytest.mark.process
async def test_disk_full_mid_round_is_a_clear_error_and_resumes(tmp_path: Path, small_disk: Path) -> None:
    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True, timeout=30)

    message = await _fill_then_grow(tmp_path, str(small_disk / "out"), grow)
    print(f"DISK FULL (tmpfs) error: {message}")


async def test_quota_exceeded_mid_round_is_a_clear_error_and_resumes(tmp_path: Path) -> None:
    # bytes, not pages: the sharded input takes ~370 KB and the whole run ~1.6 MB, so 1.5 MiB
    # (the tmpfs's size) left a ~60 KB margin that a run could finish inside; 640 KiB is full
    # during round 0 on every run
    QuotaFileSystem.reset(quota_bytes=640 * 1024)
    try:
        message = await _fill_then_grow(tmp_path, "quota://faults/out", QuotaFileSystem.grow)
    finally:
        QuotaFileSystem.reset(quota_bytes=None)
    print(f"DISK FULL (quota) error: {message}")


@pytest.mark.slow
async def test_disk_full_on_local_worker_processes_stops_the_run_and_resumes(
    tmp_path: Path, small_disk: Path, local_pool: Any
) -> None:
    """The same on real worker processes: they answer 507, the client stops the run (no quarantine)."""
    engine = {"kind": "simulated", "simulated": {"approval_rate": 0.7, "latency_a_s": 0.0, "latency_b_s": 0.0}}
    launcher = local_pool(engine_config=engine, replicas=2, concurrency=2, storage_roots=[str(tmp_path)])

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True, timeout=30)

    async def run(spec: Any, **kw: Any) -> Any:
        async with launcher.client(retries=2, backoff_s=0.05) as client:
            return await run_pipeline(spec, runner=client, **kw)

    message = await _fill_then_grow(tmp_path, str(small_disk / "out"), grow, run=run)
    print(f"DISK FULL (local workers) error: {message}")
