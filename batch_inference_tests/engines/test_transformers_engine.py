"""The transformers engine really generates with the tiny model on CPU."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from batch_inference.engines import Completion, Engine, SamplingParams, build_engine
from batch_inference.engines.base import combine_seeds

GREEDY = SamplingParams(max_tokens=8, min_tokens=8)


def test_is_an_engine(tiny_engine) -> None:
    assert isinstance(tiny_engine, Engine)
    assert tiny_engine.simulated is False and tiny_engine.max_model_len == 2048


def test_count_tokens_is_exact(tiny_engine) -> None:
    prompts = ["hello", "The quick brown fox jumps over the lazy dog."]
    counts = tiny_engine.count_tokens(prompts)
    out = tiny_engine.generate(prompts, GREEDY)
    assert counts == [c.prompt_tokens for c in out] and counts[1] > counts[0] > 0


def test_greedy_repeatable_and_padding_invariant(tiny_engine) -> None:
    alone = tiny_engine.generate(["Question: what is the capital of France?"], GREEDY)[0]
    batch = tiny_engine.generate(
        ["hi", "Question: what is the capital of France?", "A much longer prompt " * 6], GREEDY
    )
    assert alone.error is None and alone.completion_tokens == 8 and alone.text
    assert batch[1] == alone
    assert tiny_engine.generate(["Question: what is the capital of France?"], GREEDY)[0] == alone


def test_overlong_prompt_is_a_per_item_error(tiny_engine) -> None:
    long_prompt = "word " * 2100
    out = tiny_engine.generate(["first", long_prompt, "third"], SamplingParams(max_tokens=4))
    assert [c.finish_reason for c in out][1] == "error"
    assert out[1].error and out[1].error.startswith("prompt_too_long") and out[1].prompt_tokens > 2048
    assert out[0].error is None and out[2].error is None and out[0].completion_tokens > 0


def test_per_item_params_and_seeded_sampling(tiny_engine) -> None:
    sampled = SamplingParams(max_tokens=8, min_tokens=8, temperature=1.0, seed=5)
    out = tiny_engine.generate(["hello", "hello", "hello"], [GREEDY, sampled, SamplingParams(max_tokens=3, min_tokens=3)])
    assert out[0] == tiny_engine.generate(["hello"], GREEDY)[0]
    assert out[2].completion_tokens == 3
    assert out[1] == tiny_engine.generate(["hello"], sampled)[0]  # same seed, same group => same sample


def test_stop_strings_cut_the_text(tiny_engine) -> None:
    full = tiny_engine.generate(["stop test"], SamplingParams(max_tokens=12, min_tokens=12))[0]
    stop = full.text[len(full.text) // 2 :][:2]  # a piece of text the model is known to produce
    assert stop.strip(), full.text
    cut = tiny_engine.generate(["stop test"], SamplingParams(max_tokens=12, min_tokens=12, stop=[stop]))[0]
    assert cut.text == full.text[: full.text.find(stop)] and cut.finish_reason == "stop"


def test_the_stop_string_that_ended_the_text_is_reported(tiny_engine) -> None:
    full = tiny_engine.generate(["stop test"], SamplingParams(max_tokens=12, min_tokens=12))[0]
    stop = full.text[len(full.text) // 2 :][:2]
    absent = "\x00never\x00"
    cut = tiny_engine.generate(["stop test"], SamplingParams(max_tokens=12, min_tokens=12, stop=[absent, stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_sequence == stop, (full.text, cut)
    assert full.stop_sequence is None


def test_penalties_fail_their_item_alone(tiny_engine) -> None:
    out = tiny_engine.generate(["hello", "hello"], [GREEDY, SamplingParams(max_tokens=8, presence_penalty=0.5)])
    assert out[0].error is None and out[0].completion_tokens == 8
    assert out[1].finish_reason == "error" and out[1].error.startswith("bad_sampling")
    assert "presence_penalty 0.5" in out[1].error and "vLLM" in out[1].error


def fail_batches_holding(engine, marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``generate`` batch that holds the prompt ``marker`` raises, as a whole."""
    real = engine._generate_batch

    def flaky(batch, p, own=None):
        if any(engine.tokenizer.decode(ids) == marker for ids in batch):
            raise RuntimeError("boom")
        return real(batch, p, own)

    monkeypatch.setattr(engine, "_generate_batch", flaky)


def test_group_failure_falls_back_per_item(tiny_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-batch exception is retried item by item; only the bad item fails."""
    fail_batches_holding(tiny_engine, "BAD ITEM", monkeypatch)
    out = tiny_engine.generate(["good one", "BAD ITEM", "good two"], SamplingParams(max_tokens=2))
    assert [c.error is None for c in out] == [True, False, True]
    assert out[1] == Completion.failed("engine_error: RuntimeError: boom", prompt_tokens=out[1].prompt_tokens)


def test_empty_batch(tiny_engine) -> None:
    assert tiny_engine.generate([], GREEDY) == []


def test_from_config_threads(tiny_model_dir) -> None:
    import torch

    engine = build_engine({"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu", "num_threads": 1})
    assert torch.get_num_threads() == 1 and engine.device == "cpu"


def test_per_record_seeds_do_not_split_batches(tiny_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool sends one seed per record: greedy ignores it, sampling seeds the group once."""
    calls: list[int] = []
    real = tiny_engine._generate_batch
    monkeypatch.setattr(tiny_engine, "_generate_batch", lambda batch, p, own=None: calls.append(len(batch)) or real(batch, p, own))
    prompts = ["one", "two", "three"]
    greedy = tiny_engine.generate(prompts, [SamplingParams(max_tokens=4, min_tokens=4, seed=s) for s in (1, 2, 3)])
    assert calls == [3] and greedy == tiny_engine.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4))
    sampled = [SamplingParams(max_tokens=6, min_tokens=6, temperature=1.0, seed=s) for s in (1, 2, 3)]
    first = tiny_engine.generate(prompts, sampled)
    assert first == tiny_engine.generate(prompts, sampled)  # same batch, same seeds => same samples
    assert first != tiny_engine.generate(prompts, [replace(p, seed=p.seed + 10) for p in sampled])


def test_combine_seeds() -> None:
    assert combine_seeds([None, None]) is None
    assert combine_seeds([1, 2]) == combine_seeds([1, 2]) != combine_seeds([2, 1])
    assert 0 <= combine_seeds([2**64, -5, None]) < 2**63


def test_chat_prompts_are_exactly_the_chat_template_tokens(tiny_engine) -> None:
    from batch_inference.engines import ChatPrompt

    chat = ChatPrompt((("system", "be brief"), ("user", "What is the capital of France?")))
    want = tiny_engine.tokenizer.apply_chat_template(chat.as_dicts(), add_generation_prompt=True, tokenize=True)["input_ids"]
    (encoded,) = tiny_engine.encode([chat])
    assert list(encoded.ids) == want and tiny_engine.count_tokens([chat, "hi"])[0] == len(want)
    out = tiny_engine.generate([chat, "plain text"], SamplingParams(max_tokens=4, min_tokens=4))
    assert out[0].error is None and out[0].prompt_tokens == len(want) and out[0].completion_tokens == 4
    assert out[1].error is None


def test_chat_prompt_on_a_model_without_a_chat_template_fails_alone(tiny_model_dir, tmp_path) -> None:
    import shutil

    from batch_inference.engines import ChatPrompt, build_engine

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = build_engine({"kind": "transformers", "model": str(bare), "device": "cpu"})
    chat = ChatPrompt((("user", "hi"),))
    assert engine.count_tokens([chat, "hi"])[0] == 0
    out = engine.generate([chat, "hi"], SamplingParams(max_tokens=2))
    assert out[0].error.startswith("chat_template_error: the model's tokenizer has no chat template") and out[1].error is None
    engine.close()


class _OneThreadAtATime:
    """A tokenizer proxy that counts calls made while another thread was inside one."""

    def __init__(self, inner) -> None:
        self._inner, self._active, self.overlaps = inner, 0, 0
        self._lock = threading.Lock()

    def _guarded(self, fn):
        def call(*args, **kwargs):
            with self._lock:
                self._active += 1
                self.overlaps += self._active > 1
            try:
                time.sleep(0.001)  # widen the window a race needs
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._active -= 1
        return call

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        return self._guarded(attr) if callable(attr) else attr

    def __call__(self, *args, **kwargs):
        return self._guarded(self._inner)(*args, **kwargs)


def test_token_counting_and_generation_never_use_one_tokenizer_from_two_threads(tiny_engine, monkeypatch) -> None:
    """count_tokens runs on to_thread workers (one per task) while generate runs on the
    engine thread: a fast tokenizer shared between them fails ("Already borrowed")."""
    from batch_inference.engines.chat import TokenizerCopy

    guards = [_OneThreadAtATime(tiny_engine.tokenizer)]
    monkeypatch.setattr(tiny_engine, "tokenizer", guards[0])
    for value in vars(tiny_engine).values():
        if isinstance(value, TokenizerCopy):
            guards.append(_OneThreadAtATime(value.tokenizer))
            monkeypatch.setattr(value, "tokenizer", guards[-1])
    prompts = ["hello there", "The quick brown fox jumps over the lazy dog."]
    expected = tiny_engine.count_tokens(prompts)

    def count() -> list[list[int]]:
        return [tiny_engine.count_tokens(prompts) for _ in range(15)]

    with ThreadPoolExecutor(4) as pool:
        counted = [pool.submit(count) for _ in range(3)]
        generated = pool.submit(lambda: [tiny_engine.generate(prompts, GREEDY) for _ in range(3)])
        assert all(c == expected for f in counted for c in f.result())
        assert all(c.error is None for out in generated.result() for c in out)
    assert [g.overlaps for g in guards] == [0] * len(guards) and len(guards) == 2


# ----------------------------------------------------------------- batching options

BATCHINGS = ("static", "bucketed", "continuous")


@pytest.fixture(scope="module")
def engines_by_batching(tiny_model_dir):
    return {b: build_engine({"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu",
                             "transformers": {"batching": b}}) for b in BATCHINGS}


def _mixed_lengths() -> tuple[list[str], list[SamplingParams]]:
    """Fixed lengths (EOS off), free lengths, a min < max pair and a stop string, interleaved."""
    prompts = [f"Question {i}: " + "the quick brown fox " * (1 + i % 4) for i in range(12)]
    params = [SamplingParams(max_tokens=3 + 2 * (i % 5), min_tokens=3 + 2 * (i % 5)) for i in range(6)]
    params += [SamplingParams(max_tokens=4 + i) for i in range(3)]
    params += [SamplingParams(max_tokens=9, min_tokens=2), SamplingParams(max_tokens=9, min_tokens=2),
               SamplingParams(max_tokens=10, min_tokens=10, stop=("e",))]
    return prompts, params


def test_greedy_results_are_identical_across_batching_options(engines_by_batching) -> None:
    prompts, params = _mixed_lengths()
    static = engines_by_batching["static"].generate(prompts, params)
    assert [c.completion_tokens for c in static[:6]] == [3, 5, 7, 9, 11, 3] and all(c.error is None for c in static)
    for b in ("bucketed", "continuous"):
        assert engines_by_batching[b].generate(prompts, params) == static, b
        assert engines_by_batching[b].generate(prompts[:1], params[:1]) == static[:1], b


def test_bucketed_shares_calls_across_output_lengths(engines_by_batching, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engines_by_batching["bucketed"]
    calls: list[int] = []
    real = engine._generate_batch
    monkeypatch.setattr(engine, "_generate_batch", lambda batch, p, own=None: calls.append(len(batch)) or real(batch, p, own))
    prompts = ["same length prompt"] * 4
    out = engine.generate(prompts, [SamplingParams(max_tokens=n, min_tokens=n) for n in (8, 7, 8, 7)])
    assert calls == [4] and [c.completion_tokens for c in out] == [8, 7, 8, 7]


@pytest.mark.slow  # imports torch (the transformers engine module)
def test_buckets_cut_where_padding_grows() -> None:
    from batch_inference.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine.__new__(TransformersEngine)
    engine.options = build_options(bucket_padding=1.25)
    encoded = {i: [1] * 10 for i in range(4)}
    per_item = [SamplingParams(max_tokens=n) for n in (100, 10, 12, 90)]
    assert engine.buckets([0, 1, 2, 3], encoded, per_item) == [[1, 2], [3, 0]]


def build_options(**kw):
    from batch_inference.engines import TransformersOptions

    return TransformersOptions(**kw)


@pytest.mark.parametrize("batching", ["bucketed", "continuous"])
def test_batching_options_keep_per_item_errors(engines_by_batching, batching, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engines_by_batching[batching]
    if batching == "continuous":
        monkeypatch.setattr(engine, "_continuous", lambda batch, own: [
            "engine_error: boom" if engine.tokenizer.decode(ids) == "BAD ITEM" else real for ids, real in
            zip(batch, real_continuous(batch, own))])
        real_continuous = type(engine)._continuous.__get__(engine)
    else:
        fail_batches_holding(engine, "BAD ITEM", monkeypatch)
    out = engine.generate(["good one", "BAD ITEM", "good two", "word " * 2100], SamplingParams(max_tokens=2, min_tokens=2))
    assert [c.error is None for c in out] == [True, False, True, False]
    assert out[1].error and "boom" in out[1].error and out[3].error.startswith("prompt_too_long")


def test_continuous_session_failure_falls_back_to_padded(engines_by_batching, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engines_by_batching["continuous"]
    expected = engines_by_batching["static"].generate(["a b", "c d e"], SamplingParams(max_tokens=3, min_tokens=3))

    def broken(batch, own):
        raise RuntimeError("no paged attention here")

    monkeypatch.setattr(engine, "_continuous", broken)
    assert engine.generate(["a b", "c d e"], SamplingParams(max_tokens=3, min_tokens=3)) == expected
