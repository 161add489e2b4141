"""Prefix signatures: vLLM-style chained block hashes, the tokens they are made of, what a cache would do."""

from __future__ import annotations

import array
import random

import pytest

from batch_inference.engines import ChatPrompt, EngineConfig
from batch_inference.engines.chat import encode_chat
from batch_inference.engines.simulated import simulated_token_count
from batch_inference.prompting.prefix import (
    BLOCK_HASH_BYTES,
    CharTokens,
    HFTokens,
    PlainTextTokens,
    PrefixSigner,
    block_keys,
    chain_hashes,
    chars_per_token,
    default_block_size,
    distinct_blocks,
    lru_blocks_computed,
    prefix_tokenizer,
    prompt_order_key,
    shared_blocks,
    text_tokens,
)


def test_chain_hashes_name_the_whole_prefix() -> None:
    a = chain_hashes(b"aaaabbbbcccc", 4)
    b = chain_hashes(b"aaaabbbbdddd", 4)
    c = chain_hashes(b"xxxxbbbbcccc", 4)
    assert len(a) == 3 * BLOCK_HASH_BYTES
    assert shared_blocks(a, b) == 2 and shared_blocks(a, a) == 3
    # the same second block after a different first one is another block: hashes chain
    assert block_keys(a)[1] != block_keys(c)[1] and shared_blocks(a, c) == 0
    assert chain_hashes(b"aaaabb", 4) == a[:BLOCK_HASH_BYTES]  # only full blocks count
    assert chain_hashes(b"aaaabbbbcccc", 4, max_blocks=1) == a[:BLOCK_HASH_BYTES]


def test_char_tokens_are_the_simulated_engines() -> None:
    tok = CharTokens(4)
    for text in ("", "abc", "abcd", "x" * 1001):
        (packed,) = tok.pack([text], None)
        assert packed.tokens == simulated_token_count(text)
    chat = ChatPrompt((("system", "s"), ("user", "hello")))
    assert tok.pack([chat], None)[0].data == tok.pack(["system: s\nuser: hello\nassistant: "], None)[0].data


def test_hf_tokens_are_the_engines_tokens(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok = HFTokens(tokenizer)
    text = "Question: what is the capital of France? " * 3
    chat = ChatPrompt((("system", "be brief"), ("user", text)))
    packed = tok.pack([text, chat], None)
    signer = PrefixSigner(tok, block_size=4, max_blocks=1000)
    for p, prompt, ids in zip(packed, (text, chat), (list(tokenizer.encode(text)), encode_chat(tokenizer, chat))):
        assert p.tokens == len(ids)
        sig = signer.sign([prompt])[0]
        assert sig.tokens == len(ids)
        assert sig.blocks == chain_hashes(array.array("I", ids).tobytes(), 4 * 4)  # 4 tokens of 4 bytes a block


def test_auto_signs_plain_prompts_by_text_and_chat_by_the_models_tokens(tiny_model_dir) -> None:
    """``layout.signature: auto``: a plain prompt's signature is the text signer's (no
    tokenizer call), a chat prompt's the model tokenizer's, in one batch; the tokenizer is
    loaded at the first chat prompt only, and never travels to a layout worker process."""
    import pickle

    from transformers import AutoTokenizer

    engine = EngineConfig(kind="transformers", model=str(tiny_model_dir), device="cpu")
    auto = PrefixSigner.for_engine(engine, kind="auto", block_size=4, prefix_tokens=400)
    assert isinstance(auto.tokenizer, PlainTextTokens)
    by_text = PrefixSigner(CharTokens(4), block_size=4, max_blocks=100)
    by_tokens = PrefixSigner(HFTokens(AutoTokenizer.from_pretrained(str(tiny_model_dir))), block_size=4, max_blocks=100)
    texts = ["Document: the quick brown fox jumps over the lazy dog. " * 4 + f"Question {i}?" for i in range(3)]
    chat = ChatPrompt((("system", "be brief"), ("user", texts[0])))
    assert auto.sign(texts) == by_text.sign(texts)
    assert not auto.tokenizer.chat_loaded  # plain prompts only: no tokenizer loaded
    mixed = auto.sign([texts[0], chat, None, texts[1]])
    assert mixed[0] == by_text.sign([texts[0]])[0] and mixed[3] == by_text.sign([texts[1]])[0]
    assert mixed[1] == by_tokens.sign([chat])[0] and mixed[1].n_blocks > 0 and not mixed[2].blocks
    assert auto.tokenizer.chat_loaded
    shipped = pickle.loads(pickle.dumps(auto))  # as a layout worker gets it: loads its own tokenizer if it meets chat
    assert not shipped.tokenizer.chat_loaded and shipped.sign([chat, texts[2]]) == auto.sign([chat, texts[2]])
    assert "text for plain prompts" in auto.tokenizer.name and "tokenizer for chat" in auto.tokenizer.name


class _WideTokenizer:
    """A tokenizer of 16 characters a token (wider than MAX_CHARS_PER_TOKEN): cuts show."""

    chat_template = None

    def __call__(self, texts: list[str], add_special_tokens: bool = True, verbose: bool = True) -> dict:
        return {"input_ids": [[hash(t[i:i + 16]) & 0xFFFF for i in range(0, len(t), 16)] for t in texts]}


def test_a_cut_prompt_keeps_only_blocks_the_cut_cannot_change(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = HFTokens(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    long = "words of a long shared document, " * 400
    full = PrefixSigner(tok, block_size=16, max_blocks=10_000).sign([long])[0]
    capped = PrefixSigner(tok, block_size=16, max_blocks=8).sign([long])[0]
    assert capped.n_blocks == 8 and full.blocks.startswith(capped.blocks)
    # 16 characters a token: the 64 characters an 8-token signature reads make 4 tokens (2 blocks); the
    # last block ends at the cut and may differ from the whole text's: it is dropped
    wide = PrefixSigner(HFTokens(_WideTokenizer()), block_size=2, max_blocks=4)
    text = "x" * 200
    (sig,) = wide.sign([text])
    uncut = chain_hashes(array.array("I", _WideTokenizer()([text])["input_ids"][0]).tobytes(), 2 * 4)
    assert sig.n_blocks == 1 and uncut.startswith(sig.blocks)


def test_unrenderable_prompts_have_no_blocks(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = None
    signer = PrefixSigner(HFTokens(tokenizer), block_size=2, max_blocks=8)
    chat, none, text = signer.sign([ChatPrompt((("user", "hi there you"),)), None, "hello there you all"])
    assert chat.blocks == b"" and none.blocks == b"" and text.n_blocks > 0


def test_default_block_size_follows_the_engine() -> None:
    assert default_block_size(EngineConfig(kind="simulated")) == 16
    assert default_block_size(EngineConfig(kind="vllm", model="m", device="cpu")) == 128
    assert default_block_size(EngineConfig(kind="vllm", model="m")) == 16
    assert default_block_size(EngineConfig(kind="vllm", model="m", vllm={"extra": {"block_size": 32}})) == 32


def _families(n_docs: int, questions: int) -> list[str]:
    rng = random.Random(1)
    docs = ["".join(rng.choice("abcdefgh") for _ in range(64 * 4)) for _ in range(n_docs)]
    return [f"{docs[d]} q{q}" for q in range(questions) for d in range(n_docs)]  # interleaved: every doc once, then again


def test_an_lru_cache_computes_fewer_blocks_in_prefix_order() -> None:
    prompts = _families(40, 5)
    signer = PrefixSigner(CharTokens(4), block_size=16, max_blocks=64)
    sigs = [s.blocks for s in signer.sign(prompts)]
    distinct, total = distinct_blocks(sigs)
    assert distinct == 40 * 4 and total == 200 * 4
    interleaved, _ = lru_blocks_computed(sigs, capacity_blocks=20)
    ordered, _ = lru_blocks_computed(sorted(sigs), capacity_blocks=20)
    assert interleaved == total  # 40 documents do not fit: every prefix computed again
    assert ordered == distinct  # prefix order: each distinct block once


def test_prompt_order_key_groups_shared_prefixes() -> None:
    prompts = ["doc B q1", ChatPrompt((("user", "doc A"), ("user", "q2"))), "doc A q2", "doc B q0",
               ChatPrompt((("user", "doc A"), ("user", "q1"))), "doc A q1"]
    ordered = sorted(prompts, key=prompt_order_key)
    assert ordered[:4] == ["doc A q1", "doc A q2", "doc B q0", "doc B q1"]
    assert [p.messages[1][1] for p in ordered[4:]] == ["q1", "q2"]


@pytest.mark.parametrize("bad", [(0, 1), (1, 0)])
def test_signer_refuses_empty_blocks(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        PrefixSigner(CharTokens(), block_size=bad[0], max_blocks=bad[1])


class _PairTokenizer:
    """A tokenizer of 2 characters a token (a tiny model's tokenizer makes ~1.4-1.7)."""

    chat_template = None

    def __call__(self, texts: list[str], add_special_tokens: bool = True, verbose: bool = True) -> dict:
        return {"input_ids": [[hash(t[i:i + 2]) & 0xFFFF for i in range(0, len(t), 2)] for t in texts]}


def test_text_at_the_measured_characters_a_token_sees_the_models_blocks() -> None:
    """A ~300-character document is more than one 128-token block for a tokenizer of 2
    characters a token, and under one text block at 4: text signed at the figure measured
    with the tokenizer shares the document's block between its questions."""
    rng = random.Random(5)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(300)) for _ in range(3)]
    prompts = [f"{d}\nQuestion {q}?" for d in docs for q in range(4)]
    chars = chars_per_token(_PairTokenizer(), prompts)
    assert chars == 2.0
    assert chars_per_token(_PairTokenizer(), []) is None
    at_four = PrefixSigner(CharTokens(), block_size=128, max_blocks=16).sign(prompts)
    measured = PrefixSigner(CharTokens(chars), block_size=128, max_blocks=16).sign(prompts)
    assert all(s.n_blocks == 0 for s in at_four)
    assert [s.n_blocks for s in measured] == [1] * len(prompts)
    assert shared_blocks(measured[0].blocks, measured[1].blocks) == 1 and shared_blocks(measured[0].blocks, measured[4].blocks) == 0
    # a fraction of a character a token: a block is round(block_size x chars) characters
    (sig,) = PrefixSigner(CharTokens(1.5), block_size=4, max_blocks=8).sign(["abcdefghijkl"])
    assert sig.blocks == chain_hashes("abcdefghijkl".encode("utf-32-le"), 6 * 4) and sig.tokens == 8


def test_each_signature_kind_signs_text_at_the_models_measured_figure(tiny_model_dir) -> None:
    """``text``, ``auto`` and ``tokens`` alike: text's characters a token are the model's,
    measured on the run's prompts (or the figure a run recorded); the simulated engine's are 4."""
    engine = EngineConfig(kind="transformers", model=str(tiny_model_dir), device="cpu")
    sample = [f"Document {i}: " + "alpha bravo charlie delta echo foxtrot " * 8 for i in range(20)]
    figures = {kind: text_tokens(prefix_tokenizer(engine, kind, sample=sample)).chars for kind in ("text", "auto", "tokens")}
    assert len(set(figures.values())) == 1 and 1.0 < figures["text"] < 2.5, figures
    assert isinstance(prefix_tokenizer(engine, "tokens", sample=sample), HFTokens)
    assert text_tokens(prefix_tokenizer(engine, "auto", chars=1.7)).chars == 1.7  # a recorded figure: not measured again
    assert text_tokens(prefix_tokenizer(engine, "auto")).chars == 4  # nothing to measure on
    simulated = EngineConfig(kind="simulated")
    assert text_tokens(prefix_tokenizer(simulated, "auto", sample=sample)).chars == 4
