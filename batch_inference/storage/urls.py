"""URL helpers: one place that turns a URL into (filesystem, path) and checks containment.

Every fsspec URL works: a local path, ``file://``, ``memory://``, ``s3://`` (s3fs,
credentials from ``storage_options`` or the standard AWS chain).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_LOCAL_PROTOCOLS = ("file", "local")


def protocol_of(url: str) -> str:
    """The URL's scheme ("file" for plain paths)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def normalize(url: str) -> str:
    """Make plain local paths absolute; leave URLs with a scheme as they are (minus a trailing /)."""
    if "://" not in url:
        return os.path.abspath(os.path.expanduser(url))
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.rstrip('/')}" if rest.rstrip("/") else url


def join(base: str, *parts: str) -> str:
    """Join path parts onto a URL with ``/`` (never the OS separator: object stores use ``/``)."""
    out = base.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def basename(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def fs_for(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url`` and the path inside it (fsspec caches instances by options)."""
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _split(url: str) -> tuple[str, str] | None:
    """(protocol, normalised path) for containment checks, or None if the URL is unsafe."""
    proto = protocol_of(url)
    path = url.split("://", 1)[1] if "://" in url else url
    if proto in _LOCAL_PROTOCOLS:
        proto = "file"
        if not path.startswith("/"):
            if "://" in url:  # file://relative is ambiguous: refuse
                return None
            path = os.path.abspath(path)
        path = os.path.realpath(path)  # resolves `..` and symlinks
    else:
        if any(seg == ".." for seg in path.split("/")):
            return None  # object stores keep `..` literally; never let it through
        path = posixpath.normpath("/" + path)
    return proto, path.rstrip("/") or "/"


def is_under(url: str, roots: Iterable[str]) -> bool:
    """True when ``url`` lies inside one of ``roots`` (same scheme, same bucket, whole path segments).

    Rejects ``..`` traversal, other buckets, a ``file://`` URL when the root is ``s3://``,
    and prefix tricks (``/data/root2`` is not under ``/data/root``).
    """
    target = _split(url)
    if target is None:
        return False
    for root in roots:
        base = _split(root)
        if base is None or base[0] != target[0]:
            continue
        rpath, tpath = base[1], target[1]
        if tpath == rpath or tpath.startswith(rpath if rpath.endswith("/") else rpath + "/"):
            return True
    return False
