"""The result cache's key of an engine (pool.result_cache.engine_identity): everything that
decides an engine's answers is in it, or the engine's answers are not cached.

Every engine config field says whether it decides results (speckeys.Decides / Inert); the
model's files are fingerprinted whole, with a sidecar of digests so that an unchanged
multi-GB model is not hashed again at every start; a model known by a hub id alone is
identified by a pinned commit or not cached at all.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from batch_inference.engines import EngineConfig
from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.result_cache import NotCacheable, engine_identity
from batch_inference.speckeys import DIGEST_SIDECAR, DigestStats, folder_digest, undecided

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model_folder(path: Path) -> Path:
    """A model folder's files, a while after they were written (as a downloaded model's)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (path / "sub").mkdir()
    (path / "sub" / "tokenizer.json").write_text('{"vocab": {}}')
    long_ago = time.time() - 3600
    for f in path.rglob("*"):
        if f.is_file():
            os.utime(f, (long_ago, long_ago))
    return path


def _identity(**engine: Any) -> str:
    return engine_identity(EngineConfig.model_validate(engine))


def test_every_engine_config_field_decides_or_says_it_does_not() -> None:
    """A field nobody decided about would be left out of the key: a changed engine would
    answer with the old one's results. Adding one without a marker fails here."""
    assert undecided(EngineConfig) == []

    class Widened(EngineConfig):
        new_knob: int = 0

    assert undecided(Widened) == ["new_knob"]


def test_vllm_extra_and_the_structured_outputs_backend_change_the_key(tmp_path: Path) -> None:
    model = str(_model_folder(tmp_path / "model"))
    base = _identity(kind="vllm", model=model)
    changed = {
        "quantization": _identity(kind="vllm", model=model, vllm={"extra": {"quantization": "awq"}}),
        "revision": _identity(kind="vllm", model=model, vllm={"extra": {"revision": COMMIT}}),
        "backend": _identity(kind="vllm", model=model, vllm={"structured_outputs_backend": "xgrammar"}),
        "dtype": _identity(kind="vllm", model=model, dtype="float16"),
    }
    assert len({base, *changed.values()}) == 1 + len(changed), changed
    # how it runs is not in the key: the same answers
    assert _identity(kind="vllm", model=model, vllm={"gpu_memory_utilization": 0.5, "enforce_eager": True}) == base
    # a tokenizer folder of its own is fingerprinted by its content
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"vocab": {"a": 1}}')
    before = _identity(kind="vllm", model=model, vllm={"extra": {"tokenizer": str(tokenizer)}})
    (tokenizer / "tokenizer.json").write_text('{"vocab": {"b": 1}}')
    assert _identity(kind="vllm", model=model, vllm={"extra": {"tokenizer": str(tokenizer)}}) != before


def test_the_device_the_engine_resolved_and_the_simulated_answers_are_in_the_key(tmp_path: Path) -> None:
    cfg = EngineConfig(kind="transformers", model=str(_model_folder(tmp_path / "model")))
    assert engine_identity(cfg, device="cpu") != engine_identity(cfg, device="cuda")
    assert _identity(kind="simulated", simulated={"approval_rate": 0.2}) != _identity(kind="simulated", simulated={"approval_rate": 0.3})


def test_a_hub_id_is_cached_by_a_pinned_commit_or_not_at_all() -> None:
    with pytest.raises(NotCacheable, match=r"engine\.model 'org/llama' is no local file or folder.*vllm\.extra\.revision"):
        _identity(kind="vllm", model="org/llama")
    with pytest.raises(NotCacheable, match="pins no commit"):  # a branch moves
        _identity(kind="vllm", model="org/llama", vllm={"extra": {"revision": "main"}})
    pinned = _identity(kind="vllm", model="org/llama", vllm={"extra": {"revision": COMMIT}})
    assert pinned != _identity(kind="vllm", model="org/llama", vllm={"extra": {"revision": COMMIT[::-1]}})
    with pytest.raises(NotCacheable, match=r"vllm\.extra\.tokenizer_revision"):  # a hub tokenizer needs its own pin
        _identity(kind="vllm", model="org/llama", vllm={"extra": {"revision": COMMIT, "tokenizer": "org/tok"}})
    with pytest.raises(NotCacheable):  # the transformers engine takes no revision
        _identity(kind="transformers", model="org/llama")
    # the simulated engine reads no file: a folder absent here is identified by its name
    assert _identity(kind="simulated", model="org/llama")


async def test_an_engine_without_an_identity_says_why_and_is_not_cached() -> None:
    host = EngineHost({"kind": "transformers", "model": "org/llama"})
    assert await host.identity() is None
    assert host.uncacheable is not None and "org/llama" in host.uncacheable


def test_the_sidecar_spares_hashing_an_unchanged_model_and_any_change_invalidates_it(tmp_path: Path) -> None:
    model = _model_folder(tmp_path / "model")
    total = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    first = DigestStats()
    digest = folder_digest(str(model), stats=first)
    assert (first.files_hashed, first.bytes_hashed) == (3, total)
    assert (model / DIGEST_SIDECAR).is_file()
    second = DigestStats()  # the next start (a new process reads the sidecar)
    assert folder_digest(str(model), stats=second) == digest
    assert (second.files_hashed, second.bytes_hashed, second.files_reused) == (0, 0, 3)
    (model / "sub" / "tokenizer.json").touch()  # a touch: the same bytes, hashed again to know it
    touched = DigestStats()
    assert folder_digest(str(model), stats=touched) == digest
    assert (touched.files_hashed, touched.bytes_hashed) == (1, (model / "sub" / "tokenizer.json").stat().st_size)
    # written within the last seconds, its mtime may not show a next write yet: hashed again until it is older
    again = DigestStats()
    assert folder_digest(str(model), stats=again) == digest and again.files_hashed == 1
    os.utime(model / "sub" / "tokenizer.json", (time.time() - 60, time.time() - 60))
    assert folder_digest(str(model)) == digest
    # a same-size edit in the middle whose mtime is put back: its ctime still says it changed
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = DigestStats()
    assert folder_digest(str(model), stats=edited) != digest
    assert edited.bytes_hashed == weights.stat().st_size
    # the sidecar is not part of the fingerprint, and a copy's (other inodes) is not trusted
    copy = tmp_path / "pod" / "model"
    shutil.copytree(model, copy)
    copied = DigestStats()
    assert folder_digest(str(copy), stats=copied) == folder_digest(str(model))
    assert copied.files_hashed == 3


def _key_as_written_before(identity: str, prompt: Any, params: Any, attempt: int, ignores_seed: bool) -> str | None:
    """The store key as every earlier version computed it, spelled out: a stored entry keeps
    answering only while this formula holds."""
    import dataclasses
    import hashlib

    from batch_inference.engines import ChatPrompt

    if params.temperature > 0 and params.seed is None:
        return None
    if params.temperature == 0 and ignores_seed:
        params = dataclasses.replace(params, seed=None)
    body = (("chat", prompt.messages) if isinstance(prompt, ChatPrompt) else ("text", prompt), params)
    return hashlib.blake2b(repr(("v1", identity, attempt, body)).encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


@pytest.mark.parametrize("ignores_seed", [True, False])
def test_the_store_key_is_the_one_earlier_versions_wrote(ignores_seed: bool) -> None:
    from batch_inference.engines import ChatPrompt, ResponseFormat, SamplingParams
    from batch_inference.pool.dedup import identity_text, memo_key, request_key
    from batch_inference.pool.result_cache import cache_key

    prompts = ["plain", "quotes ' \" and \\ and unicode é 漢字 \ud800", ChatPrompt((("system", "be terse"), ("user", "hi 'x'")))]
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, seed=7), SamplingParams(temperature=0.7, seed=3, stop=("\n", "END")),
              SamplingParams(temperature=0.7), SamplingParams(adapter="sql", min_tokens=2, max_tokens=9, presence_penalty=0.5),
              SamplingParams(response_format=ResponseFormat("json_object"))]
    seen: set[str] = set()
    for prompt in prompts:
        for p in params:
            for attempt in (0, 3):
                key = cache_key("model-id", prompt, p, attempt, greedy_ignores_seed=ignores_seed)
                assert key == _key_as_written_before("model-id", prompt, p, attempt, ignores_seed), (prompt, p, attempt)
                text = identity_text(prompt, p, greedy_ignores_seed=ignores_seed)
                assert (text is None) == (key is None)
                if text is not None:
                    assert request_key("scope", prompt, p, attempt, greedy_ignores_seed=ignores_seed) == memo_key("scope", attempt, text)
                    seen.add(key)
    assert len(seen) == len(prompts) * (len(params) - 1) * 2 - (len(prompts) * 2 if ignores_seed else 0)
