"""What a spec key means beyond its type, declared where the key is: on the config models' fields.

Two markers go in a field's ``Annotated`` metadata (pydantic keeps them in ``FieldInfo.metadata``):

- ``Decides``: the field's value decides a run's results, so a run resumed with it changed
  would mix two specs' results (``pipeline.spec.result_changes``). A marked field counts
  whole, a model-typed one with every field inside it; an unmarked model-typed field counts
  by the marks of its own fields, so ``engine`` counts its ``model`` but not its pool tuning.
  ``folders``: the value names local folders (a string, or a mapping's values) whose
  files decide too, fingerprinted by their content (:func:`folder_digest`); ``grows``: a mapping whose new
  keys decide nothing until something names them (an engine serving one more adapter).
- ``LocalPath``: a local path, or a list or mapping of them; a spec file's relative ones
  resolve from the file's folder (:func:`resolve_paths`), whatever the process's cwd.

Imports nothing of the project: every layer's config models use it.
"""

from __future__ import annotations

import hashlib
import os
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
class LocalPath:
    """Field metadata: a local path (or a list or mapping of them)."""


DECIDES = Decides()
FOLDER = Decides(folders=True)
NAMED_FOLDERS = Decides(folders=True, grows=True)
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


SAMPLE_BYTES = 1 << 20  # a file's content is hashed whole up to twice this size, else its first and last this many bytes


def folder_digest(path: str) -> str | None:
    """A fingerprint of a local folder's files by content: each file's relative name and
    size, and its bytes (whole up to ``2 * SAMPLE_BYTES``, else the first and the last
    ``SAMPLE_BYTES``: retrained weights differ throughout). Copies of the same files give the
    same digest wherever they sit and whatever their mtimes (a model copied into each pod),
    and a few MiB are read per file, so every resumed step can afford it. None when ``path``
    is no local folder (a URL, or absent here)."""
    if "://" in path or not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                with open(full, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    h.update(f"{os.path.relpath(full, path)}\0{size}\n".encode())
                    h.update(f.read(SAMPLE_BYTES))
                    if size > 2 * SAMPLE_BYTES:
                        f.seek(size - SAMPLE_BYTES)
                    h.update(f.read(SAMPLE_BYTES))
            except OSError:
                continue
    return h.hexdigest()[:16]


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
