"""Prefix signatures: chained hashes over fixed-size token blocks of a rendered request.

vLLM's prefix cache keys every *full* block of ``block_size`` tokens by a hash of the
block's tokens and its parent block's hash. Two requests therefore share cached KV for
exactly the leading blocks whose chained hashes agree. A ``Signature`` is that chain,
8 bytes per block, concatenated: two requests share a cached prefix of ``k`` blocks
when the first ``8 k`` bytes of their signatures agree (``shared_blocks``), and sorting
signatures as bytes puts every family of requests that share a prefix next to each
other (a depth-first walk of the prefix tree), which is the order a cache of limited
size wants.

Tokens come from a ``PrefixTokenizer``:

- ``HFTokens``: the model's own tokenizer (text with special tokens added, chat through
  its chat template, the tokens the engine computes: ``engines.chat``);
- ``CharTokens``: a token is a fixed number of characters of the prompt's text (chat as
  ``engines.chat.prompt_text`` writes it). With 4 characters it is the simulated
  engine's tokenizer (``engines.simulated.simulated_token_count``); for a real model it
  is the cheap path: a shared text prefix is a shared token prefix, so it groups the same
  families at a fraction of the cost (no tokenizer call per record). Its characters a
  token are the model's, measured once a run on a sample of the run's prompts
  (``chars_per_token``): a block of text is then about a block of the model's tokens, so
  the text pass sees the blocks the engine's cache will share (at a constant 4, a tiny
  model's ~1.7 put a 128-token block of ~220 characters under one 512-character text block);
- ``PlainTextTokens`` (``layout.signature: auto``, the default): plain prompts by text,
  chat by the model's tokenizer (a chat template's turns are tokens text cannot place).

Only the first ``max_blocks`` blocks count (a signature's size is bounded); tokens are
packed into bytes (``Packed.width`` bytes per token) so hashing never loops over tokens in Python.
Shared by the layout pass (pipeline.placement), the prefix families the layout cuts
between and the pool dispatches by (``common_blocks``, ``family_key``), in-worker
submission order and figures that predict the cache (``lru_blocks_computed``, ``distinct_blocks``).
"""

from __future__ import annotations

import array
import itertools
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple, Protocol

from batch_inference.engines.base import ChatPrompt, Prompt
from batch_inference.engines.blocks import BLOCK_HASH_BYTES, block_keys, chain_hashes  # as the engines key their caches
from batch_inference.engines.chat import ChatTemplateError, has_chat_template, prompt_text
from batch_inference.engines.config import EngineConfig

log = logging.getLogger(__name__)

SignatureKind = Literal["auto", "tokens", "text"]
VLLM_GPU_BLOCK_SIZE = 16  # vLLM's default block size on CUDA
VLLM_CPU_BLOCK_SIZE = 128  # vLLM-CPU's block size
SIMULATED_CHARS_PER_TOKEN = 4  # engines.simulated: one token per 4 characters
CALIBRATION_PROMPTS = 256  # prompts a run's characters a token are measured on, at most ...
CALIBRATION_CHARS = 65_536  # ... and characters (at least one prompt): ~10-30 ms of tokenising
MIN_CHARS_PER_TOKEN = 0.5  # the measured figure is kept within [MIN, MAX]_CHARS_PER_TOKEN
# A tokenizer is given at most this many characters per token it is asked for: a rendered
# prompt is cut there before tokenising (the blocks past max_blocks are dropped anyway).
MAX_CHARS_PER_TOKEN = 8
CUT_MARGIN_TOKENS = 16  # tokens this close to a cut may tokenise differently from the whole text


class Signature(NamedTuple):
    """A request's block-hash chain (``BLOCK_HASH_BYTES`` per full block) and its token count
    (all of the prompt's tokens when known, else those the chain covers)."""

    blocks: bytes
    tokens: int

    @property
    def n_blocks(self) -> int:
        return len(self.blocks) // BLOCK_HASH_BYTES


EMPTY = Signature(b"", 0)


def shared_blocks(a: bytes, b: bytes) -> int:
    """Leading blocks two signatures (their ``blocks``) have in common."""
    n = min(len(a), len(b)) // BLOCK_HASH_BYTES
    lo, hi = 0, n  # the chain is prefix-closed: block k agrees only if every block before it does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        end = mid * BLOCK_HASH_BYTES
        if a[end - BLOCK_HASH_BYTES:end] == b[end - BLOCK_HASH_BYTES:end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------ prefix families
#
# One definition for the layout's cuts (pipeline.placement) and the pool's dispatch
# (pipeline.affinity, pool.client): records belong to one *prefix family* when they share
# a block past the ``common`` blocks every record at hand shares (a template's preamble,
# however long). A family is named by the chain hash of its first block past them, which
# names the whole prefix up to there; a boundary between two sorted records is between
# families when they share no more than ``common`` blocks.


def common_blocks(signatures: Iterable[bytes]) -> int:
    """Leading blocks every one of these signatures shares (0 for none): the prefix every
    request at hand has, cached once whatever the order or the worker."""
    first: bytes | None = None
    common = 0
    for blocks in signatures:
        if first is None:
            first, common = blocks, len(blocks) // BLOCK_HASH_BYTES
        else:
            common = min(common, shared_blocks(first, blocks))
        if common == 0:
            break
    return common


def family_key(blocks: bytes, common: int) -> str | None:
    """The prefix family of a request signed ``blocks``, among requests sharing ``common``
    blocks: the hex hash of its first block past them; None when it has none (its prompt
    ends within the common prefix: nothing of its own to keep cached)."""
    end = (common + 1) * BLOCK_HASH_BYTES
    return blocks[end - BLOCK_HASH_BYTES:end].hex() if len(blocks) >= end else None


# ------------------------------------------------------------------ tokenizers


class Packed(NamedTuple):
    """A prompt's first tokens packed as bytes, ``width`` bytes a token (each prompt's own:
    ``PlainTextTokens`` packs text and token ids side by side; text's is 4 bytes a character
    times its characters a token, not always whole), how many tokens were made (all of the
    prompt's unless ``cut``), and whether the text was cut before tokenising."""

    data: bytes
    tokens: int
    width: float
    cut: bool = False

    def block_bytes(self, block_size: int) -> int:
        """Bytes of ``block_size`` tokens: whole 4-byte units (a token id, a UTF-32 character)."""
        return 4 * max(1, round(block_size * self.width / 4))


class PrefixTokenizer(Protocol):
    """Prompts to packed tokens, at most ``max_tokens`` each (None: all)."""

    name: str

    def pack(self, prompts: Sequence[Prompt], max_tokens: int | None) -> list[Packed]: ...


class CharTokens:
    """``chars`` characters of the prompt's text per token (UTF-32: 4 bytes a character;
    ``chars`` need not be whole: a block of ``b`` tokens is ``round(b x chars)`` characters)."""

    def __init__(self, chars: float = SIMULATED_CHARS_PER_TOKEN) -> None:
        if chars <= 0:
            raise ValueError(f"characters a token must be > 0, got {chars}")
        self.chars = chars
        self.width = 4 * chars
        self.name = f"text ({chars:g} characters a token)"

    def pack(self, prompts: Sequence[Prompt], max_tokens: int | None) -> list[Packed]:
        out = []
        for p in prompts:
            text = prompt_text(p)
            n = max(1, math.ceil(len(text) / self.chars))
            if max_tokens is not None:
                text = text[:math.ceil(max_tokens * self.chars)]
            out.append(Packed(text.encode("utf-32-le"), n, self.width))
        return out


class HFTokens:
    """A Hugging Face tokenizer: the tokens the engine computes (``engines.chat``'s rules).

    Text is tokenised with special tokens added; chat is rendered by the model's chat
    template (generation prompt added) and tokenised without adding any (the template
    carries them), which is what ``apply_chat_template(tokenize=True)`` does. A prompt
    longer than ``max_tokens x MAX_CHARS_PER_TOKEN`` characters is cut there first, and
    the block the cut may have changed is dropped. Texts go to the tokenizer in one
    batched call.
    """

    width = 4

    def __init__(self, tokenizer: Any, name: str = "tokenizer", text_chars: float = SIMULATED_CHARS_PER_TOKEN) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.text_chars = text_chars  # the text pass's estimate of this tokenizer (``chars_per_token``)

    def _render(self, p: Prompt) -> tuple[str, bool]:
        if isinstance(p, ChatPrompt):
            if not has_chat_template(self.tokenizer):
                raise ChatTemplateError("no chat template")
            return self.tokenizer.apply_chat_template(p.as_dicts(), add_generation_prompt=True, tokenize=False), False
        return p, True

    def pack(self, prompts: Sequence[Prompt], max_tokens: int | None) -> list[Packed]:
        limit = None if max_tokens is None else max_tokens * MAX_CHARS_PER_TOKEN
        out = [Packed(b"", 0, self.width)] * len(prompts)
        groups: dict[bool, list[tuple[int, str, bool]]] = {True: [], False: []}
        for i, p in enumerate(prompts):
            try:
                text, special = self._render(p)
            except Exception:  # the engine gives this prompt its error; it has no prefix to share
                continue
            cut = limit is not None and len(text) > limit
            groups[special].append((i, text[:limit] if cut else text, cut))
        for special, items in groups.items():
            if not items:
                continue
            encoded = self.tokenizer([t for _, t, _ in items], add_special_tokens=special, verbose=False)["input_ids"]
            for (i, _, cut), ids in zip(items, encoded):
                out[i] = Packed(array.array("I", ids[:max_tokens] if max_tokens is not None else ids).tobytes(), len(ids),
                                self.width, cut)
        return out


class PlainTextTokens:
    """Plain prompts by their text (``CharTokens``), chat by the model's tokenizer
    (``HFTokens``, loaded at the first chat prompt: a run of plain prompts never loads it).

    On plain prompts the text's order is the tokens' order, at a fraction of the cost (the
    tokenizer is most of a layout pass: bench/reports/layout_cost.md); a chat template's
    role markers and turns are tokens the text cannot place, so chat keeps the tokenizer.
    """

    def __init__(self, engine: EngineConfig, chars: float = SIMULATED_CHARS_PER_TOKEN) -> None:
        self.engine = engine
        self.text = CharTokens(chars)
        self.name = f"text for plain prompts ({chars:g} characters a token), {engine.model}'s tokenizer for chat"
        self._chat: PrefixTokenizer | None = None

    def __getstate__(self) -> dict[str, Any]:  # a layout worker process loads its own tokenizer, when it meets chat
        return {**self.__dict__, "_chat": None}

    @property
    def chat_loaded(self) -> bool:
        """Whether the model's tokenizer is loaded here (only once a chat prompt came)."""
        return self._chat is not None

    def _chat_tokens(self) -> PrefixTokenizer:
        if self._chat is None:
            self._chat = prefix_tokenizer(self.engine, "tokens")
        return self._chat

    def pack(self, prompts: Sequence[Prompt], max_tokens: int | None) -> list[Packed]:
        chat = [i for i, p in enumerate(prompts) if isinstance(p, ChatPrompt)]
        if not chat:
            return self.text.pack(prompts, max_tokens)
        out = [Packed(b"", 0, self.text.width)] * len(prompts)
        plain = [i for i, p in enumerate(prompts) if not isinstance(p, ChatPrompt)]
        for idx, tokenizer in ((plain, self.text), (chat, self._chat_tokens())):
            if idx:
                for i, p in zip(idx, tokenizer.pack([prompts[i] for i in idx], max_tokens)):
                    out[i] = p
        return out


def chars_per_token(tokenizer: Any, prompts: Sequence[Prompt]) -> float | None:
    """Characters a token of ``tokenizer`` (a Hugging Face tokenizer, or a ``tokenizers.Tokenizer``)
    over the first prompts of ``prompts`` (``CALIBRATION_PROMPTS`` and ``CALIBRATION_CHARS`` at
    most; their text, as ``CharTokens`` reads it), rounded to 0.01 and kept within
    ``MIN_CHARS_PER_TOKEN``..``MAX_CHARS_PER_TOKEN``; None when there is no text to measure."""
    texts: list[str] = []
    chars = 0
    for text in itertools.islice((prompt_text(p) for p in prompts), CALIBRATION_PROMPTS):
        if text and (not texts or chars + len(text) <= CALIBRATION_CHARS):
            texts.append(text)
            chars += len(text)
    if not texts:
        return None
    if callable(tokenizer):
        tokens = sum(map(len, tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]))
    else:  # tokenizers.Tokenizer: special tokens added by default, as the engine adds them
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    if not tokens:
        return None
    return round(min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, chars / tokens)), 2)


def prompt_order_key(prompt: Prompt) -> tuple[int, Any]:
    """A sort key that puts prompts sharing a prefix next to each other without tokenising:
    text sorts as a string, chat as its (role, content) turns (text before chat). A shared
    text prefix is a shared token prefix, so a chunk sorted by it submits families together."""
    return (0, prompt) if isinstance(prompt, str) else (1, prompt.messages)


# ------------------------------------------------------------------ signer


def default_block_size(engine: EngineConfig) -> int:
    """The engine's KV block size: ``vllm.extra.block_size`` when set, else vLLM's default
    (128 on ``device: cpu``, 16 elsewhere: GPUs). Other engines have no paged cache; they
    get vLLM's GPU size, the size their requests would be cached at there."""
    if engine.kind == "vllm":
        size = engine.vllm.extra.get("block_size")
        if isinstance(size, int) and size > 0:
            return size
        return VLLM_CPU_BLOCK_SIZE if engine.device == "cpu" else VLLM_GPU_BLOCK_SIZE
    return VLLM_GPU_BLOCK_SIZE


def _load_tokenizer(engine: EngineConfig) -> Any | None:
    """The model's Hugging Face tokenizer, or None (logged) where it cannot be loaded here."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("prefix signatures: transformers is not installed here; signing %s's prompts by text instead", engine.model)
        return None
    try:
        return AutoTokenizer.from_pretrained(engine.model)
    except Exception as exc:  # a model only the workers can reach: order by text, say so
        log.warning("prefix signatures: cannot load %s's tokenizer here (%s); signing its prompts by text instead", engine.model, exc)
        return None


def _measuring_tokenizer(engine: EngineConfig) -> Any | None:
    """A tokenizer to measure characters a token with, without a per-record tokenizer: a local
    model's ``tokenizer.json`` through ``tokenizers`` (~15 ms to import and load, where
    transformers takes seconds to import on a driver that has not), else the model's own."""
    path = os.path.join(engine.model, "tokenizer.json")
    if os.path.isfile(path):
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - a file tokenizers cannot read: the model's own loader
            log.debug("prefix signatures: %s through tokenizers: %s", path, exc)
    return _load_tokenizer(engine)


def prefix_tokenizer(engine: EngineConfig, kind: SignatureKind = "tokens", *, sample: Sequence[Prompt] = (),
                     chars: float | None = None) -> PrefixTokenizer:
    """The tokens a signature is made of, for this engine.

    ``tokens``: the simulated engine's 4 characters a token, or the model's own tokenizer
    (``transformers.AutoTokenizer``; where it cannot be loaded, the text path, logged).
    ``text``: characters (no tokenizer per record). ``auto``: text for plain prompts, the
    model's tokenizer for chat (``PlainTextTokens``). Text's characters a token are
    ``chars`` when given (a figure the run recorded), else measured with the model's
    tokenizer on ``sample`` (``chars_per_token``, ``_measuring_tokenizer``), else 4 (no
    sample, no tokenizer here); the simulated engine's are 4 (its tokenizer).
    """
    if engine.kind == "simulated":
        return CharTokens(SIMULATED_CHARS_PER_TOKEN)
    tokenizer = _load_tokenizer(engine) if kind == "tokens" else None
    if chars is None and sample:
        measuring = tokenizer if tokenizer is not None else _measuring_tokenizer(engine)
        if measuring is not None:
            chars = chars_per_token(measuring, sample)
            log.info("prefix signatures: %s makes %s characters a token on the run's first prompts", engine.model, chars)
    chars = chars or SIMULATED_CHARS_PER_TOKEN
    if kind == "text" or (kind == "tokens" and tokenizer is None):
        return CharTokens(chars)
    if kind == "auto":
        return PlainTextTokens(engine, chars)  # the model's tokenizer loaded at the first chat prompt
    return HFTokens(tokenizer, name=f"{engine.model}'s tokenizer", text_chars=chars)


def text_tokens(tokenizer: PrefixTokenizer) -> CharTokens:
    """The text a signer's first, cheap pass signs by (``pipeline.placement``'s gate): the
    text tokens themselves, or text at the characters a token measured for the tokenizer."""
    if isinstance(tokenizer, CharTokens):
        return tokenizer
    if isinstance(tokenizer, PlainTextTokens):
        return tokenizer.text
    return CharTokens(getattr(tokenizer, "text_chars", SIMULATED_CHARS_PER_TOKEN))


class PrefixSigner:
    """Prompts to ``Signature``s: ``block_size`` tokens a block, the first ``max_blocks``."""

    def __init__(self, tokenizer: PrefixTokenizer, *, block_size: int, max_blocks: int) -> None:
        if block_size < 1 or max_blocks < 1:
            raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size}, {max_blocks}")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    @classmethod
    def for_engine(cls, engine: EngineConfig, *, kind: SignatureKind = "tokens", block_size: int | None = None,
                   prefix_tokens: int = 2048, sample: Sequence[Prompt] = (), chars: float | None = None) -> PrefixSigner:
        """``sample``/``chars``: text's characters a token (``prefix_tokenizer``)."""
        size = block_size or default_block_size(engine)
        return cls(prefix_tokenizer(engine, kind, sample=sample, chars=chars), block_size=size,
                   max_blocks=max(1, prefix_tokens // size))

    @property
    def max_tokens(self) -> int:
        return self.block_size * self.max_blocks

    def sign(self, prompts: Sequence[Prompt | None]) -> list[Signature]:
        """One signature per prompt (``EMPTY`` for None: a record with no request)."""
        live = [i for i, p in enumerate(prompts) if p is not None]
        out = [EMPTY] * len(prompts)
        packed = self.tokenizer.pack([prompts[i] for i in live], self.max_tokens)  # type: ignore[misc]
        for i, p in zip(live, packed):
            blocks = chain_hashes(p.data, p.block_bytes(self.block_size), self.max_blocks)
            if p.cut and p.tokens - len(blocks) // BLOCK_HASH_BYTES * self.block_size < CUT_MARGIN_TOKENS:
                blocks = blocks[:-BLOCK_HASH_BYTES]  # its tokens end near the cut: they may differ from the engine's
            out[i] = Signature(blocks, p.tokens)
        return out


# ------------------------------------------------------------------ what a cache would do


def distinct_blocks(signatures: Iterable[bytes]) -> tuple[int, int]:
    """(distinct blocks, all blocks) over signatures: the distinct ones are what a cache of
    unlimited size computes (in memory: for samples and tests)."""
    seen: set[bytes] = set()
    total = 0
    for blocks in signatures:
        keys = block_keys(blocks)
        total += len(keys)
        seen.update(keys)
    return len(seen), total


def lru_blocks_computed(signatures: Iterable[bytes], capacity_blocks: int) -> tuple[int, int]:
    """(blocks computed, all blocks) for requests in this order through an LRU cache of
    ``capacity_blocks`` blocks (a block hit when its chain hash is cached; a request's own
    blocks are pinned while it runs, as vLLM pins them, so a request never evicts itself)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    cache: OrderedDict[bytes, None] = OrderedDict()
    computed = total = 0
    for blocks in signatures:
        keys = block_keys(blocks)
        total += len(keys)
        for key in keys:
            if key in cache:
                cache.move_to_end(key)
            else:
                computed += 1
                cache[key] = None
        while len(cache) > max(capacity_blocks, len(keys)):
            cache.popitem(last=False)
    return computed, total
