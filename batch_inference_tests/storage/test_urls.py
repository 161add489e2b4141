from __future__ import annotations

import os

import pytest

from batch_inference.storage import urls


def test_join_and_normalize() -> None:
    assert urls.join("s3://b/run/", "sharded", "part-00001.jsonl") == "s3://b/run/sharded/part-00001.jsonl"
    assert urls.normalize("rel/dir") == os.path.abspath("rel/dir")
    assert urls.normalize("memory://x/") == "memory://x"


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("/data/root/run/part-00000.jsonl", True),
        ("/data/root", True),
        ("file:///data/root/a.jsonl", True),
        ("/data/root/../other/a.jsonl", False),  # traversal
        ("/data/root2/a.jsonl", False),  # prefix trick
        ("/etc/passwd", False),  # absolute path elsewhere
        ("s3://bucket/root/a.jsonl", True),
        ("s3://bucket/root/../secret/a.jsonl", False),
        ("s3://bucket/root2/a.jsonl", False),
        ("s3://other/root/a.jsonl", False),  # other bucket
        ("memory://bucket/root/a.jsonl", False),  # other scheme
        ("file:///bucket/root/a.jsonl", False),  # file:// when the root is s3://
    ],
)
def test_is_under(url: str, ok: bool) -> None:
    assert urls.is_under(url, ["/data/root", "s3://bucket/root/"]) is ok


def test_is_under_follows_symlinks_out_of_root(tmp_path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert urls.is_under(str(root / "a.jsonl"), [str(root)])
    assert not urls.is_under(str(root / "link" / "a.jsonl"), [str(root)])
