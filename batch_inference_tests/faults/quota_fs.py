"""``quota://``: an in-memory fsspec filesystem whose writes fail with ENOSPC past a quota.

The disk-full test prefers a real small tmpfs (the kernel's ENOSPC); where mounting is not
allowed (not root) it runs the same scenario on this filesystem, which raises exactly what
a full disk raises (``OSError(errno.ENOSPC)``) from the write that crosses the quota.
"""

from __future__ import annotations

import errno
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem


class _QuotaFile(MemoryFile):
    def write(self, data: Any) -> int:
        fs: QuotaFileSystem = self.fs
        if fs.quota_bytes is not None and fs.used_bytes() + len(data) > fs.quota_bytes:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return super().write(data)


class QuotaFileSystem(MemoryFileSystem):
    """Memory filesystem (its own store) with ``quota_bytes`` of space; None = unlimited."""

    protocol = "quota"
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    quota_bytes: ClassVar[int | None] = None

    @classmethod
    def used_bytes(cls) -> int:
        return sum(f.getbuffer().nbytes for f in cls.store.values())

    @classmethod
    def reset(cls, quota_bytes: int | None) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.quota_bytes = quota_bytes

    @classmethod
    def grow(cls, quota_bytes: int | None = None) -> None:
        """More space (None: unlimited), keeping what is stored."""
        cls.quota_bytes = quota_bytes

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "w" in mode or "a" in mode or "x" in mode:
            f.__class__ = _QuotaFile
        return f


fsspec.register_implementation("quota", QuotaFileSystem, clobber=True)
