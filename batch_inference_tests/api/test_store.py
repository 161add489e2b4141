"""The API server's storage: removing a stopped batch's run while its last task still writes."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from batch_inference.api.store import Store


def test_a_folder_that_fills_again_while_it_is_removed_is_removed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CI failure: DELETE of a just-cancelled batch answered 500 (rmtree: 'Directory not
    # empty: checkpoints') while the batch's last worker-side task wrote one more checkpoint
    store = Store(str(tmp_path))
    run = tmp_path / "runs" / "b1" / "checkpoints"
    run.mkdir(parents=True)
    (run / "c0.json").write_text("{}")
    real_rm, calls = store.fs.rm, []

    def rm_racing_a_writer(path: str, recursive: bool = False) -> None:
        calls.append(path)
        if len(calls) == 1:  # as shutil.rmtree fails when a file appears behind it
            raise OSError(errno.ENOTEMPTY, "Directory not empty", "checkpoints")
        real_rm(path, recursive=recursive)

    # fsspec caches its filesystems (one LocalFileSystem per process): patched for this test only
    monkeypatch.setattr(store.fs, "rm", rm_racing_a_writer)
    store.remove(store.url("runs", "b1"), pause_s=0.01)
    assert len(calls) == 2 and not (tmp_path / "runs" / "b1").exists()


def test_a_folder_that_never_empties_is_an_error_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(str(tmp_path))
    calls = []

    def rm_always_refused(path: str, recursive: bool = False) -> None:
        calls.append(path)
        raise OSError(errno.ENOTEMPTY, "Directory not empty", "checkpoints")

    monkeypatch.setattr(store.fs, "rm", rm_always_refused)
    with pytest.raises(OSError, match="not empty"):
        store.remove(store.url("runs", "b2"), attempts=3, pause_s=0.01)
    assert len(calls) == 3


def test_a_served_file_is_the_version_it_opened_even_when_replaced_meanwhile(tmp_path: Path) -> None:
    # a response pairing one version's length with another's bytes cut a line mid-string:
    # the size and the bytes both come from the one open file
    store = Store(str(tmp_path))
    url = store.url("files", "file-abc", "content")
    first = b"".join(b'{"custom_id": "r%d", "text": "short"}\n' % i for i in range(3000))
    writer = store.open_writer(url)
    writer.write(first)
    writer.commit()
    snapshot = store.snapshot(url)
    try:
        replacement = store.open_writer(url)  # a larger version lands under the same name while it is served
        replacement.write(first.replace(b"short", b"much longer than before"))
        replacement.commit()
        served = b""
        while chunk := snapshot.read():
            served += chunk
    finally:
        snapshot.close()
    assert snapshot.size == len(first) and served == first
