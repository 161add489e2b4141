from __future__ import annotations

import pytest
import zstandard

from batch_inference.storage import CheckpointStore, JsonlFile, urls


async def test_append_writes_one_segment_per_call_and_load_merges(base_url: str) -> None:
    store = CheckpointStore(urls.join(base_url, "ckpt"))
    assert await store.load() == {}
    await store.append([{"id": f"s{i}", "attempt": 0, "last_result": None} for i in range(2000)])
    await store.append([{"id": "s1", "attempt": 1, "last_result": "draft"}, {"id": "s2", "attempt": 1}])
    await store.append([{"id": "s1", "attempt": 2, "last_result": None}])
    await store.append([])  # nothing to save: no segment
    assert len(store.segments()) == 3
    state = await store.load()
    assert len(state) == 2000
    assert state["s1"] == {"id": "s1", "attempt": 2, "last_result": None}
    assert state["s2"] == {"id": "s2", "attempt": 1, "last_result": None}  # merged field by field
    assert state["s7"]["attempt"] == 0


async def test_compact_folds_segments_without_changing_state(base_url: str) -> None:
    store = CheckpointStore(urls.join(base_url, "ckpt"))
    for a in range(5):
        await store.append([{"id": f"s{i}", "attempt": a} for i in range(10)])
    before = await store.load()
    await store.compact()
    assert len(store.segments()) == 1
    await store.append([{"id": "s0", "attempt": 9}])  # appends after a compaction still win
    after = await store.load()
    assert after == {**before, "s0": {"id": "s0", "attempt": 9}}


async def test_half_written_segments_are_ignored(tmp_path) -> None:
    url = str(tmp_path / "ckpt")
    store = CheckpointStore(url)
    await store.append([{"id": "a", "attempt": 1}, {"id": "b", "attempt": 1}])
    # a writer killed mid-upload leaves only its hidden temp file behind ...
    (tmp_path / "ckpt" / ".seg-99999999999999999999-x.jsonl.zst.tmp-abc").write_bytes(b"\x28\xb5\x2f\xfd partial")
    # ... and a segment damaged by something else is read up to the damage
    good = zstandard.ZstdCompressor().compress(b'{"id": "a", "attempt": 2}\n{"id": "b", "att')
    (tmp_path / "ckpt" / "seg-99999999999999999999-00000000-ffffffff.jsonl.zst").write_bytes(good[: len(good) - 3])
    state = await store.load()
    assert state["b"] == {"id": "b", "attempt": 1}
    assert state["a"]["attempt"] in (1, 2)


async def test_state_without_id_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="without an 'id'"):
        await CheckpointStore(str(tmp_path / "c")).append([{"attempt": 1}])
    assert not JsonlFile(str(tmp_path / "c")).exists_sync() or CheckpointStore(str(tmp_path / "c")).segments() == []
