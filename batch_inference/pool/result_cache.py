"""Results kept across runs: a content-addressed store of deterministic completions.

A scheduled run over a corpus that grew by a few records recomputes nothing it computed
before. The run's request memo (``pool.dedup``) computes identical requests of one phase
once per worker; this is its persistent sibling, with the same rule of what may be reused
(``dedup.request_identity``: temperature 0, or an explicit seed) and the same request
identity (the prompt as rendered by the builder: text, or the chat messages the engine
renders with its one template; the sampling, adapter included; the attempt), plus the
model's identity (``engine_identity``: every engine config key that decides results, a
content fingerprint of the model's and every adapter's files hashed whole,
``speckeys.folder_digest``, the engine libraries' versions and the resolved device).
A changed weight or adapter file changes every key: it never hits. A model known by a hub
id alone (no pinned commit) has no identity: its requests are never cached.

Layout, under the run's output root (``<output>/_result_cache`` unless the spec says):
one small JSON object per key, ``<k[:2]>/<k[2:4]>/<k>.json``, written once and never
changed (content-addressed: two workers writing the same key write the same answer, the
last one wins and both are right). A read that is not a whole entry of its own key (a torn
local write, foreign damage) is a miss, never an error. Lookups go in bulk: a task looks up
a whole chunk's keys with one ``fs.cat`` of their paths, which s3fs (and every async
fsspec store) runs concurrently, and writes a chunk's new entries with one ``fs.pipe``.

Bounded: ``trim`` (the driver, once per run) deletes the oldest entries (by modification
time: on local disk a hit refreshes it, so least recently used; on an object store the write
time) until the store is under ``max_bytes``, and the temporary files of writers that died
between their write and their rename (older than ``TEMP_GRACE_S``: a live writer's file is
seconds old at most). docs/cache.md says what it costs and where the layout stops scaling.
"""

from __future__ import annotations

import asyncio
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
from batch_inference.pool.dedup import request_identity
from batch_inference.storage.urls import fs_for, is_local

log = logging.getLogger(__name__)

FORMAT = "v1"  # in every key: a change of what an entry means starts a fresh keyspace
TEMP_SUFFIX = ".tmp"  # a local writer's file before its rename: ``.<key>.json.<pid>.<ns>.tmp``
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
    body = request_identity(prompt, params, greedy_ignores_seed=greedy_ignores_seed)
    if body is None:
        return None
    digest = hashlib.blake2b(repr((FORMAT, identity, attempt, body)).encode("utf-8", "surrogatepass"), digest_size=20)
    return digest.hexdigest()


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
    """The store at ``url`` (local or any fsspec URL): bulk ``get_many`` / ``put_many``, ``trim``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fs_for(self.url, dict(storage_options or {}))
        self.local = is_local(self.fs)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key[:2]}/{key[2:4]}/{key}.json"

    # -- blocking halves (run off the event loop) ---------------------------------------

    def get_many_sync(self, keys: Sequence[str]) -> dict[str, Completion]:
        """The entries found among ``keys`` (missing and unreadable ones left out)."""
        if not keys:
            return {}
        paths = {self._path(k): k for k in dict.fromkeys(keys)}
        if self.local:  # one open per key: no listing, no exists() round trip
            blobs: dict[str, bytes] = {}
            for p in paths:
                try:
                    with open(p, "rb") as f:
                        blobs[p] = f.read()
                    os.utime(p)  # a hit is a use: trim evicts the least recently used
                except OSError:
                    continue
        else:
            try:
                blobs = self.fs.cat(list(paths), on_error="omit")
            except FileNotFoundError:
                blobs = {}
            blobs = {self.fs._strip_protocol(p) if p not in paths else p: b for p, b in blobs.items()}
        found: dict[str, Completion] = {}
        for path, blob in blobs.items():
            key = paths.get(path)
            if key is None:
                continue
            if (completion := _decode(key, blob)) is not None:
                found[key] = completion
        return found

    def put_many_sync(self, entries: Mapping[str, Completion]) -> None:
        """Store successful completions (a failed one is never an answer to reuse)."""
        blobs = {self._path(k): _encode(k, c) for k, c in entries.items() if c.error is None}
        if not blobs:
            return
        if self.local:
            # the fewest system calls an entry: its folder made when missing (no makedirs stat
            # first), its file written unbuffered; a thread writing thousands of them fights the
            # task's event loop for the GIL at every call
            pid, made = os.getpid(), set()
            for path, blob in blobs.items():
                parent, name = path.rsplit("/", 1)
                if parent not in made:
                    _make_folder(parent)
                    made.add(parent)
                tmp = f"{parent}/.{name}.{pid}.{time.monotonic_ns()}{TEMP_SUFFIX}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # open()'s mode
                try:
                    os.write(fd, blob)  # an entry is a few hundred bytes: one write
                finally:
                    os.close(fd)
                os.replace(tmp, path)  # atomic: a reader sees the whole entry or none
        else:
            self.fs.pipe(blobs)  # one PUT per entry, run concurrently; an object store PUT is atomic

    def trim(self, max_bytes: int, *, temp_grace_s: float = TEMP_GRACE_S) -> TrimReport:
        """Delete the oldest entries until the store holds at most ``max_bytes``, and every
        temporary file older than ``temp_grace_s`` (a writer killed before its rename left it;
        a younger one may be a live writer's, so it stays) (blocking)."""
        try:
            self.fs.invalidate_cache(self.root)
            listing = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return TrimReport(0, 0, 0, 0)
        files = [(info.get("size") or 0, _mtime(info), path) for path, info in listing.items() if info.get("type", "file") == "file"]
        entries = [f for f in files if f[2].endswith(".json")]
        cutoff = time.time() - temp_grace_s
        leaked = [f for f in files if _is_temporary(f[2]) and f[1] < cutoff]
        total = sum(size for size, _, _ in entries)
        evicted: list[str] = []
        evicted_bytes = 0
        if total > max_bytes:
            for size, _, path in sorted(entries, key=lambda e: e[1]):
                if total - evicted_bytes <= max_bytes:
                    break
                evicted.append(path)
                evicted_bytes += size
        doomed = evicted + [path for _, _, path in leaked]
        for i in range(0, len(doomed), 1000):
            try:
                self.fs.rm(doomed[i:i + 1000])
            except FileNotFoundError:  # another run trimmed it first (or its writer renamed it after all)
                pass
        return TrimReport(len(entries) - len(evicted), total - evicted_bytes, len(evicted), evicted_bytes,
                          len(leaked), sum(size for size, _, _ in leaked))

    # -- async ---------------------------------------------------------------------------

    async def get_many(self, keys: Sequence[str]) -> dict[str, Completion]:
        return await asyncio.to_thread(self.get_many_sync, keys)

    async def put_many(self, entries: Mapping[str, Completion]) -> None:
        await asyncio.to_thread(self.put_many_sync, entries)


def _make_folder(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` with one call when only the last level is missing."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)


def _is_temporary(path: str) -> bool:
    """Whether ``path`` is a local writer's file before its rename (``put_many_sync``)."""
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


__all__ = ["FORMAT", "TEMP_GRACE_S", "NotCacheable", "ResultCache", "TrimReport", "cache_key", "engine_identity"]
