"""Results kept across runs: a content-addressed store of deterministic completions.

A scheduled run over a corpus that grew by a few records recomputes nothing it computed
before. The run's request memo (``pool.dedup``) computes identical requests of one phase
once per worker; this is its persistent sibling, with the same rule of what may be reused
(``dedup.identity_text``: temperature 0, or an explicit seed) and the same request
identity (the prompt as rendered by the builder: text, or the chat messages the engine
renders with its one template; the sampling, adapter included; the attempt), plus the
model's identity (``engine_identity``: every engine config key that decides results, a
content fingerprint of the model's and every adapter's files hashed whole,
``speckeys.folder_digest``, the engine libraries' versions and the resolved device).
A changed weight or adapter file changes every key: it never hits. A model known by a hub
id alone (no pinned commit) has no identity: its requests are never cached.

Layout, under the run's output root (``<output>/_result_cache`` unless the spec says). On
local disk: one SQLite file, ``entries.sqlite3`` (``pool.result_db``): a chunk's lookups are
one indexed query per 500 keys, its new entries one transaction; a file per entry cost 0.23-0.38 ms
of CPU a request (``bench/result_cache_writes.py``). On an object store: one small JSON object per key,
``<k[:2]>/<k[2:4]>/<k>.json``, looked up with one ``fs.cat`` of a chunk's paths (s3fs and
every async fsspec store run them concurrently) and written with one ``fs.pipe``; each PUT is
atomic. Entries are content-addressed: two workers writing the same key write the same
answer, the last one wins and both are right. An entry that is not whole, or not its own
key's (a torn write, foreign damage), is a miss, never an error.

Bounded: ``trim`` (the driver, once per run) deletes the least recently used entries until
the store is under ``max_bytes`` (on an object store, by write time: first in, first out).
A local store an earlier version wrote (a file per entry) is read on a miss and moved into
the database by the first trim, which deletes the temporary files its writers left when
killed between write and rename. docs/cache.md says what it costs and where it stops scaling.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batch_inference import speckeys
from batch_inference.engines import Completion, EngineConfig, Prompt, SamplingParams
from batch_inference.pool.dedup import identity_text
from batch_inference.pool.result_db import ResultDb
from batch_inference.storage.urls import fs_for, is_local

log = logging.getLogger(__name__)

FORMAT = "v1"  # in every key: a change of what an entry means starts a fresh keyspace
TEMP_SUFFIX = ".tmp"  # an earlier version's local writer's file before its rename: ``.<key>.json.<pid>.<ns>.tmp``
# A temporary file older than this is a dead writer's: a live one renames its file (a few
# hundred bytes) within milliseconds of opening it, so an hour leaves a stalled disk room.
TEMP_GRACE_S = 3600.0


PINNED_COMMIT = re.compile(r"[0-9a-f]{40}")  # a hub revision that names one commit (a branch or tag moves)
# The libraries whose code computes an engine kind's answers: an upgrade may change them
RUNTIME_PACKAGES = {"transformers": ("torch", "transformers", "peft"), "vllm": ("vllm", "torch", "transformers")}


class NotCacheable(ValueError):
    """The engine's answers cannot be keyed by what decides them (a model named by a hub id
    with no pinned commit): its requests are computed, never looked up nor kept."""


def engine_identity(config: EngineConfig, *, device: str | None = None) -> str:
    """The model's identity for cache keys: every engine config key marked as deciding results
    (``speckeys.Decides``: kind, model, dtype, seed, max_model_len, adapters, vLLM's ``extra``
    and structured outputs backend, the simulated engine's answers), the content of every
    file they name (``speckeys.folder_digest``: the model folder, each adapter's, vLLM's
    ``extra.tokenizer``), the versions of the libraries that compute the answers, and the
    ``device`` the engine resolved (``auto`` means float32 on a CPU, bfloat16 on a GPU).

    A model, adapter or tokenizer that is no local file or folder here is identified by its
    pinned commit (``vllm.extra.revision`` / ``tokenizer_revision``, 40 hex digits) or not at
    all: raises ``NotCacheable``. Blocking: the first call after a file changed hashes it whole."""
    data = config.model_dump(mode="json")
    marked = speckeys.decided(EngineConfig, data)
    decided = {key: value for key, (_, value) in marked.items()}
    files: dict[str, str | None] = {}
    for key, (mark, value) in marked.items():
        if mark.folders and isinstance(value, str):
            files[key] = _content(config, key, value, config.vllm.extra.get("revision") if key == "model" and config.kind == "vllm" else None)
    if config.kind == "vllm" and isinstance(tokenizer := config.vllm.extra.get("tokenizer"), str):
        files["vllm.extra.tokenizer"] = _content(config, "vllm.extra.tokenizer", tokenizer, config.vllm.extra.get("tokenizer_revision"))
    runtime = {name: _version(name) for name in RUNTIME_PACKAGES.get(config.kind, ())}
    blob = json.dumps({"engine": decided, "files": files, "runtime": runtime, "device": device,
                       "simulated": data.get("simulated") if config.kind == "simulated" else None},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _content(config: EngineConfig, key: str, value: str, revision: Any) -> str | None:
    """What identifies the files ``value`` names: their content, else a pinned commit; the
    simulated engine reads no file, so a name absent here is its own identity."""
    if (digest := speckeys.folder_digest(value)) is not None:
        return digest
    if isinstance(revision, str) and PINNED_COMMIT.fullmatch(revision):
        return f"revision:{revision}"
    if config.kind == "simulated":
        return None
    pin = "vllm.extra.tokenizer_revision" if key == "vllm.extra.tokenizer" else "vllm.extra.revision" if key == "model" else None
    raise NotCacheable(f"engine.{key} {value!r} is no local file or folder here, so its content cannot be fingerprinted"
                       + (f", and {pin} pins no commit (40 hex digits)" if pin and config.kind == "vllm" else ""))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(identity: str, prompt: Prompt, params: SamplingParams, attempt: int, *, greedy_ignores_seed: bool) -> str | None:
    """The store's key of one request on the model ``identity`` (hex), or None when its outcome
    is not deterministic (temperature > 0 without a seed): never reused."""
    text = identity_text(prompt, params, greedy_ignores_seed=greedy_ignores_seed)
    return None if text is None else store_key(identity, attempt, text)


def store_key(identity: str, attempt: int, request: str) -> str:
    """The store's key of a request's ``dedup.identity_text`` on the model ``identity``: the
    hex blake2b of ``repr((FORMAT, identity, attempt, ((kind, prompt), sampling)))``, as every
    version wrote it (a stored entry keeps answering)."""
    text = f"({FORMAT!r}, {identity!r}, {attempt!r}, {request})"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


@dataclass
class TrimReport:
    """What one ``trim`` found and removed: entries, and the temporary files dead writers left."""

    entries: int
    bytes: int
    evicted: int
    evicted_bytes: int
    leaked_temporaries: int = 0
    leaked_temporary_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"entries": self.entries, "bytes": self.bytes, "evicted": self.evicted, "evicted_bytes": self.evicted_bytes,
                "leaked_temporaries": self.leaked_temporaries, "leaked_temporary_bytes": self.leaked_temporary_bytes}


class ResultCache:
    """The store at ``url``: bulk ``get_many`` / ``put_many``, ``trim``. On local disk one
    SQLite file (``pool.result_db``); on an object store one object per entry."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fs_for(self.url, dict(storage_options or {}))
        self.local = is_local(self.fs)
        self.db = ResultDb(self.root) if self.local else None
        # a local store an earlier version wrote holds a file per entry: read (and moved into
        # the database) on a miss until the driver's trim has moved them all
        self._legacy = self.local and _has_entry_folders(self.root)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key[:2]}/{key[2:4]}/{key}.json"

    # -- blocking halves (run off the event loop) ---------------------------------------

    def get_many_sync(self, keys: Sequence[str]) -> dict[str, Completion]:
        """The entries found among ``keys`` (missing and unreadable ones left out)."""
        if not keys:
            return {}
        if self.db is not None:
            blobs = self.db.get_many(keys)
            if self._legacy and (missed := [k for k in dict.fromkeys(keys) if k not in blobs]):
                blobs.update(self._adopt_legacy(missed))
            return _decoded(blobs)
        paths = {self._path(k): k for k in dict.fromkeys(keys)}
        try:
            found = self.fs.cat(list(paths), on_error="omit")
        except FileNotFoundError:
            found = {}
        return _decoded({key: blob for path, blob in found.items()
                         if (key := paths.get(path, paths.get(self.fs._strip_protocol(path)))) is not None})

    def put_many_sync(self, entries: Mapping[str, Completion]) -> None:
        """Store successful completions (a failed one is never an answer to reuse)."""
        blobs = {k: _encode(k, c) for k, c in entries.items() if c.error is None}
        if not blobs:
            return
        if self.db is not None:
            self.db.put_many(blobs)  # one transaction
        else:
            self.fs.pipe({self._path(k): b for k, b in blobs.items()})  # one PUT per entry, run concurrently; each atomic

    def trim(self, max_bytes: int, *, temp_grace_s: float = TEMP_GRACE_S) -> TrimReport:
        """Delete the least recently used entries until the store holds at most ``max_bytes``
        (blocking). On local disk, first move an earlier version's entry files into the
        database and delete them, with the temporary files its writers left when killed
        between write and rename (older than ``temp_grace_s``; a younger one may be live)."""
        if self.db is not None:
            leaked = self._adopt_all_legacy(temp_grace_s) if _has_entry_folders(self.root) else (0, 0)
            evicted, evicted_bytes = self.db.evict(max_bytes)
            entries, total = self.db.totals()
            return TrimReport(entries, total, evicted, evicted_bytes, *leaked)
        try:
            self.fs.invalidate_cache(self.root)
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return TrimReport(0, 0, 0, 0)
        entries = [(info.get("size") or 0, _mtime(info), path) for path, info in listing.items()
                   if info.get("type", "file") == "file" and path.endswith(".json")]
        total = sum(size for size, _, _ in entries)
        evicted: list[str] = []
        evicted_bytes = 0
        if total > max_bytes:
            for size, _, path in sorted(entries, key=lambda e: e[1]):
                if total - evicted_bytes <= max_bytes:
                    break
                evicted.append(path)
                evicted_bytes += size
        for i in range(0, len(evicted), 1000):
            try:
                self.fs.rm(evicted[i:i + 1000])
            except FileNotFoundError:  # another run trimmed it first
                pass
        return TrimReport(len(entries) - len(evicted), total - evicted_bytes, len(evicted), evicted_bytes)

    # -- an earlier version's local layout: a file per entry ------------------------------

    def _adopt_legacy(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The entry files of ``keys`` that exist, moved into the database."""
        blobs: dict[str, bytes] = {}
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    blobs[key] = f.read()
            except OSError:
                continue
        if blobs:
            assert self.db is not None
            self.db.put_many(blobs)
            for key in blobs:
                with contextlib.suppress(OSError):
                    os.unlink(self._path(key))
        return blobs

    def _adopt_all_legacy(self, temp_grace_s: float) -> tuple[int, int]:
        """Every entry file moved into the database (its mtime its last use) and deleted, with
        the dead writers' temporary files: (temporaries deleted, their bytes)."""
        assert self.db is not None
        cutoff = time.time() - temp_grace_s
        leaked = [0, 0]
        for top in _entry_folders(self.root):
            for folder, _, names in os.walk(top, topdown=False):
                blobs: dict[str, bytes] = {}
                used: dict[str, float] = {}
                for name in names:
                    path = os.path.join(folder, name)
                    try:
                        st = os.stat(path)
                        if _is_temporary(name):
                            if st.st_mtime < cutoff:
                                os.unlink(path)
                                leaked[0] += 1
                                leaked[1] += st.st_size
                        elif name.endswith(".json"):
                            with open(path, "rb") as f:
                                blobs[name[:-5]] = f.read()
                            used[name[:-5]] = st.st_mtime
                    except OSError:
                        continue
                self.db.put_many(blobs, used=used)
                for key in blobs:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(folder, key + ".json"))
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # left while a live writer's temporary is in it
        return leaked[0], leaked[1]

    # -- async ---------------------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> dict[str, Completion]:
        return await asyncio.to_thread(self.get_many_sync, keys)

    async def put_many(self, entries: Mapping[str, Completion]) -> None:
        await asyncio.to_thread(self.put_many_sync, entries)


def _decoded(blobs: Mapping[str, bytes]) -> dict[str, Completion]:
    """The blobs that are whole entries of their own keys, as completions."""
    return {key: c for key, blob in blobs.items() if (c := _decode(key, blob)) is not None}


_ENTRY_FOLDER = re.compile(r"[0-9a-f]{2}")


def _entry_folders(root: str) -> list[str]:
    """The top folders of an earlier version's layout (``<k[:2]>/<k[2:4]>/<k>.json``)."""
    try:
        return [os.path.join(root, n) for n in os.listdir(root) if _ENTRY_FOLDER.fullmatch(n) and os.path.isdir(os.path.join(root, n))]
    except OSError:
        return []


def _has_entry_folders(root: str) -> bool:
    return bool(_entry_folders(root))


def _is_temporary(path: str) -> bool:
    """Whether ``path`` is an earlier version's local writer's file before its rename."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def _mtime(info: Mapping[str, Any]) -> float:
    value = info.get("mtime", info.get("LastModified", info.get("last_modified", 0)))
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _encode(key: str, c: Completion) -> bytes:
    return json.dumps({"key": key, "text": c.text, "prompt_tokens": c.prompt_tokens,
                       "completion_tokens": c.completion_tokens, "finish_reason": c.finish_reason,
                       **({"stop_sequence": c.stop_sequence} if c.stop_sequence is not None else {}),
                       **({"embedding": list(c.embedding)} if c.embedding is not None else {})},
                      ensure_ascii=False).encode("utf-8", "surrogatepass")


def _decode(key: str, blob: bytes) -> Completion | None:
    """The entry's completion, or None when the bytes are not a whole entry of this key."""
    try:
        data = json.loads(blob)
        if data.get("key") != key or not isinstance(data.get("text"), str):
            return None
        return Completion(text=data["text"], prompt_tokens=int(data["prompt_tokens"]),
                          completion_tokens=int(data["completion_tokens"]), finish_reason=data["finish_reason"], from_cache=True,
                          stop_sequence=data.get("stop_sequence"),
                          embedding=tuple(float(x) for x in data["embedding"]) if data.get("embedding") is not None else None)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


__all__ = ["FORMAT", "TEMP_GRACE_S", "NotCacheable", "ResultCache", "TrimReport", "cache_key", "engine_identity", "store_key"]
