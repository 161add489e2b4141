"""What a spec key means beyond its type, declared where the key is: on the config models' fields.

Three markers go in a field's ``Annotated`` metadata (pydantic keeps them in ``FieldInfo.metadata``):

- ``Decides``: the field's value decides a run's results, so a run resumed with it changed
  would mix two specs' results (``pipeline.spec.result_changes``), and the result cache
  keys an engine's answers by it (``pool.result_cache.engine_identity``). A marked field counts
  whole, a model-typed one with every field inside it; an unmarked model-typed field counts
  by the marks of its own fields, so ``engine`` counts its ``model`` but not its pool tuning.
  ``folders``: the value names local folders (a string, or a mapping's values) whose
  files decide too, fingerprinted by their content (:func:`folder_digest`); ``grows``: a mapping whose new
  keys decide nothing until something names them (an engine serving one more adapter).
- ``Inert``: the field says how the work is carried out, never what it answers (a pool's
  tuning, an engine's memory share). Where every field must be decided one way or the
  other (the engine config: :func:`undecided`), a new field without either marker is an
  error, so the cache's key cannot go stale by someone forgetting it.
- ``LocalPath``: a local path, or a list or mapping of them; a spec file's relative ones
  resolve from the file's folder (:func:`resolve_paths`), whatever the process's cwd.

Imports nothing of the project: every layer's config models use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo

M = TypeVar("M")


@dataclass(frozen=True)
class Decides:
    """Field metadata: the value decides results (see the module docstring)."""

    folders: bool = False
    grows: bool = False


@dataclass(frozen=True)
class Inert:
    """Field metadata: the value decides no result (see the module docstring)."""


@dataclass(frozen=True)
class LocalPath:
    """Field metadata: a local path (or a list or mapping of them)."""


DECIDES = Decides()
FOLDER = Decides(folders=True)
NAMED_FOLDERS = Decides(folders=True, grows=True)
INERT = Inert()
PATH = LocalPath()


def marker(field: FieldInfo, kind: type[M]) -> M | None:
    """The field's marker of ``kind``, or None."""
    return next((m for m in field.metadata if isinstance(m, kind)), None)


def submodels(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds directly (``EngineConfig | None`` -> EngineConfig)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in submodels(arg)]
    return []


def _leaves(key: str, value: Any, mark: Decides) -> Iterator[tuple[str, tuple[Decides, Any]]]:
    if isinstance(value, Mapping) and value and not mark.folders:
        for k, v in value.items():
            yield from _leaves(f"{key}.{k}", v, mark)
    elif isinstance(value, Mapping) and mark.folders:
        for k, v in value.items():
            yield f"{key}.{k}", (mark, v)
    else:
        yield key, (mark, value)


def decided(model: type[BaseModel], data: Mapping[str, Any] | None, prefix: str = "") -> dict[str, tuple[Decides, Any]]:
    """The result-deciding values of ``data`` (a ``model`` as JSON) by dotted key, with their marks."""
    data = data if isinstance(data, Mapping) else {}
    out: dict[str, tuple[Decides, Any]] = {}
    for name, field in model.model_fields.items():
        key, value = f"{prefix}{name}", data.get(name)
        if (mark := marker(field, Decides)) is not None:
            out.update(_leaves(key, value, mark))
        else:
            for sub in submodels(field.annotation)[:1]:
                out.update(decided(sub, value, f"{key}."))
    return out


def undecided(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted names of ``model``'s fields marked neither ``Decides`` nor ``Inert`` (a
    model-typed field unmarked: those of its own fields): where each must be decided, an
    empty list."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        if marker(field, Decides) is not None or marker(field, Inert) is not None:
            continue
        subs = submodels(field.annotation)
        if not subs:
            out.append(f"{prefix}{name}")
        for sub in subs:
            out.extend(undecided(sub, f"{prefix}{name}."))
    return out


DIGEST_SCHEME = "sha256"  # a fingerprint's prefix: one of another scheme (or none: sampled, before) is not comparable
DIGEST_SIDECAR = ".batch_inference_digests.json"  # beside the files it describes; never part of a fingerprint
HASH_CHUNK_BYTES = 8 << 20
# A file modified this recently when it was hashed may change again within its mtime's
# resolution (coarse on some filesystems) without its stat changing: hashed, never remembered.
RACY_NS = 2_000_000_000


@dataclass
class DigestStats:
    """What fingerprinting read: files and bytes hashed, files whose sidecar digest stood."""

    files_hashed: int = 0
    bytes_hashed: int = 0
    files_reused: int = 0


def _stat_key(st: os.stat_result) -> dict[str, int]:
    """What says a file is the one hashed: any write, rename over it or copy changes one of these."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _hash_file(path: str, stats: DigestStats) -> str:
    """The file's sha256, read whole in chunks (hashlib releases the GIL on each chunk)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            stats.bytes_hashed += n
    stats.files_hashed += 1
    return h.hexdigest()


def _read_sidecar(root: str) -> dict[str, dict[str, Any]]:
    try:
        with open(os.path.join(root, DIGEST_SIDECAR), "rb") as f:
            data = json.load(f)
        files = data.get("files") if isinstance(data, dict) and data.get("scheme") == DIGEST_SCHEME else None
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError):  # none yet, unreadable, or damaged: hash again
        return {}


def _write_sidecar(root: str, files: dict[str, dict[str, Any]]) -> None:
    """Keep the digests beside the files (temp file and rename); a folder we may not write
    (a read-only mount) just costs hashing again at the next start."""
    path = os.path.join(root, DIGEST_SIDECAR)
    tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"scheme": DIGEST_SCHEME, "files": files}, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _files(path: str) -> tuple[str, list[str]]:
    """(the folder whose sidecar holds the digests, the relative names to fingerprint, sorted)."""
    if os.path.isfile(path):
        return os.path.dirname(path) or ".", [os.path.basename(path)]
    names = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        names.extend(os.path.relpath(os.path.join(root, name), path) for name in sorted(files)
                     if not name.startswith(DIGEST_SIDECAR))
    return path, names


def folder_digest(path: str, *, stats: DigestStats | None = None) -> str | None:
    """A fingerprint of a local folder's files (or of one local file) by content: each file's
    relative name, size and sha256 of its whole bytes, so no edit escapes it, a same-size one
    in the middle of a weights file included. Copies of the same files give the same
    fingerprint wherever they sit and whatever their mtimes (a model copied into each pod).

    Hashing gigabytes once is fine, at every step not: each file's digest is kept in a
    sidecar beside it (``DIGEST_SIDECAR``) with its size, mtime, ctime, inode and device, and
    read back while all of those are unchanged; any write, rename or copy changes one, and
    the file is hashed again. Blocking (hashes in the calling thread): call it off the event
    loop. None when ``path`` is no local file or folder (a URL, a hub id, absent here)."""
    if "://" in path or not os.path.exists(path):
        return None
    stats = stats if stats is not None else DigestStats()
    root, names = _files(path)
    known = _read_sidecar(root)
    kept: dict[str, dict[str, Any]] = {}
    changed = False
    h = hashlib.sha256()
    for rel in names:
        full = os.path.join(root, rel)
        try:
            started = time.time_ns()
            st = os.stat(full)
            key = _stat_key(st)
            entry = known.get(rel)
            if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and isinstance(entry.get(DIGEST_SCHEME), str):
                digest = entry[DIGEST_SCHEME]
                stats.files_reused += 1
            else:
                digest = _hash_file(full, stats)
                changed = True
            if st.st_mtime_ns < started - RACY_NS:
                kept[rel] = {**key, DIGEST_SCHEME: digest}
        except OSError:  # vanished or unreadable since the listing: not part of what loads
            continue
        h.update(f"{rel}\0{key['size']}\0{digest}\n".encode())
    if path != root:  # a single file: its folder's sidecar keeps its other files' digests too
        kept = {**{k: v for k, v in known.items() if k not in kept and k not in names}, **kept}
    if changed or kept.keys() != known.keys():
        _write_sidecar(root, kept)
    return f"{DIGEST_SCHEME}:{h.hexdigest()[:32]}"


def comparable_digests(a: str, b: str) -> bool:
    """Whether two fingerprints were made the same way (a ledger may hold one made before
    fingerprints hashed files whole: comparing it would call every folder changed)."""
    return a.partition(":")[0] == b.partition(":")[0] if ":" in a and ":" in b else ":" not in a and ":" not in b


def _resolved(value: Any, base: Path) -> Any:
    if isinstance(value, str):
        if not value or "://" in value:
            return value
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else base / p)
    if isinstance(value, list):
        return [_resolved(v, base) for v in value]
    if isinstance(value, Mapping):
        return {k: _resolved(v, base) for k, v in value.items()}
    return value


def resolve_paths(model: type[BaseModel], data: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """``data`` (a ``model`` as a mapping, before validation) with the relative local paths of
    its ``LocalPath`` fields made absolute under ``base``; everything else as given."""
    out = dict(data)
    for name, field in model.model_fields.items():
        if name not in out or out[name] is None:
            continue
        if marker(field, LocalPath) is not None:
            out[name] = _resolved(out[name], base)
        elif isinstance(out[name], Mapping):
            for sub in submodels(field.annotation)[:1]:
                out[name] = resolve_paths(sub, out[name], base)
    return out
