"""Prefix-cache blocks: chained hashes over full token blocks, as vLLM keys its prefix cache.

vLLM caches the KV of every *full* block of ``block_size`` tokens under a hash of the
block's tokens and its parent block's hash, so a block's hash names its whole prefix and
two requests share cached KV for exactly the leading blocks whose hashes agree. A
request never hits its last token (it must compute at least one), so of ``n`` prompt
tokens only the first ``(n - 1) // block_size`` blocks can come from the cache
(``cacheable_blocks``). Engines with a prefix cache sign a request's ``Tokens`` with these
(``prefix_signature``): the pool counts the distinct blocks of a phase (the ideal: each
distinct prefix computed once) and the simulated engine's cache keys its blocks by them.
"""

from __future__ import annotations

import array
import base64
import hashlib
import math
import struct
import zlib
from collections.abc import Sequence

BLOCK_HASH_BYTES = 8


def chain_hashes(data: bytes, block_bytes: int, max_blocks: int | None = None) -> bytes:
    """The chained ``BLOCK_HASH_BYTES``-byte hashes of ``data``'s full blocks of ``block_bytes`` bytes.

    Block ``i``'s hash is ``blake2b(hash(i - 1) + block i)``: it names the whole prefix up
    to and including block ``i``.
    """
    n = len(data) // block_bytes
    if max_blocks is not None:
        n = min(n, max_blocks)
    out = bytearray()
    parent = b""
    blake2b = hashlib.blake2b
    for i in range(n):
        parent = blake2b(parent + data[i * block_bytes:(i + 1) * block_bytes], digest_size=BLOCK_HASH_BYTES).digest()
        out += parent
    return bytes(out)


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Leading full blocks of a prompt its prefill may take from the cache (never its last token)."""
    return max(0, prompt_tokens - 1) // block_size


def block_keys(blocks: bytes) -> list[bytes]:
    """A signature's block hashes one by one (each names its whole prefix: a cache key)."""
    return [blocks[i:i + BLOCK_HASH_BYTES] for i in range(0, len(blocks), BLOCK_HASH_BYTES)]


def ids_signature(ids: Sequence[int], block_size: int) -> bytes:
    """The chained hashes of a prompt's cacheable blocks of token ids (4 bytes a token)."""
    n = cacheable_blocks(len(ids), block_size) * block_size
    return chain_hashes(array.array("I", ids[:n]).tobytes(), 4 * block_size)


def text_signature(text: str, prompt_tokens: int, block_size: int, chars_per_token: int = 4) -> bytes:
    """The chained hashes of a prompt's cacheable blocks where a token is ``chars_per_token``
    characters of its text (the simulated engine's tokenizer): 4 bytes a character."""
    chars = cacheable_blocks(prompt_tokens, block_size) * block_size * chars_per_token
    return chain_hashes(text[:chars].encode("utf-32-le"), 4 * chars_per_token * block_size)


class DistinctBlocks:
    """How many distinct block hashes a stream of signatures holds: exact while small, then a
    HyperLogLog sketch.

    A phase's ideal prefill (each distinct prefix computed once) is its distinct cacheable
    blocks; a worker sees only its own requests, so each task keeps a sketch of its blocks
    and the driver merges them (``merge``: the union). Up to ``exact_limit`` blocks it keeps
    the hashes themselves (exact); past that, ``2**precision`` one-byte registers (4 KiB at
    12: about 1.6% standard error), whatever the number of blocks. The block hashes are
    already uniform, so their own bits index and rank.
    """

    def __init__(self, precision: int = 12, registers: bytes | None = None, *, exact_limit: int = 1024) -> None:
        if not 4 <= precision <= 16:
            raise ValueError(f"precision must be in [4, 16], got {precision}")
        self.precision = precision
        self.exact_limit = exact_limit
        self.exact: set[bytes] | None = set() if registers is None else None
        self.registers = bytearray(registers) if registers is not None else bytearray(1 << precision)
        if len(self.registers) != 1 << precision:
            raise ValueError(f"{len(self.registers)} registers for precision {precision}")

    def add(self, blocks: bytes) -> None:
        """Every block hash of a signature (``BLOCK_HASH_BYTES`` each)."""
        n = len(blocks) // BLOCK_HASH_BYTES
        if not n:
            return
        if self.exact is not None:
            self.exact.update(blocks[i:i + BLOCK_HASH_BYTES] for i in range(0, n * BLOCK_HASH_BYTES, BLOCK_HASH_BYTES))
            if len(self.exact) > self.exact_limit:
                self._to_registers()
            return
        self._add_registers(blocks[:n * BLOCK_HASH_BYTES])

    def _add_registers(self, blocks: bytes) -> None:
        p = self.precision
        shift, mask, width = 64 - p, (1 << (64 - p)) - 1, 64 - p + 1
        reg = self.registers
        for h in struct.unpack(f">{len(blocks) // BLOCK_HASH_BYTES}Q", blocks):
            i = h >> shift
            rank = width - (h & mask).bit_length()
            if rank > reg[i]:
                reg[i] = rank

    def _to_registers(self) -> None:
        exact, self.exact = self.exact, None
        if exact:
            self._add_registers(b"".join(exact))

    def merge(self, other: DistinctBlocks) -> None:
        if other.precision != self.precision:
            raise ValueError(f"cannot merge sketches of precision {other.precision} and {self.precision}")
        if other.exact is not None:
            self.add(b"".join(other.exact))
            return
        if self.exact is not None:
            self._to_registers()
        reg = self.registers
        for i, r in enumerate(other.registers):
            if r > reg[i]:
                reg[i] = r

    def estimate(self) -> int:
        """The distinct blocks added (exact while small; then HyperLogLog, with linear
        counting while registers are empty)."""
        if self.exact is not None:
            return len(self.exact)
        m = len(self.registers)
        zeros = self.registers.count(0)
        if zeros == m:
            return 0
        alpha = 0.7213 / (1 + 1.079 / m)
        raw = alpha * m * m / sum(2.0 ** -r for r in self.registers)
        if raw <= 2.5 * m and zeros:
            return round(m * math.log(m / zeros))
        return round(raw)

    def to_text(self) -> str:
        """Compact text (zlib + base64, ``x:`` the exact hashes, ``h:`` the registers): what a task reports."""
        if self.exact is not None:
            return "x:" + base64.b64encode(zlib.compress(b"".join(sorted(self.exact)), 6)).decode("ascii")
        return "h:" + base64.b64encode(zlib.compress(bytes(self.registers), 6)).decode("ascii")

    @classmethod
    def from_text(cls, text: str, precision: int = 12) -> DistinctBlocks:
        kind, _, body = text.partition(":")
        data = zlib.decompress(base64.b64decode(body))
        if kind == "x":
            out = cls(precision)
            out.add(data)
            return out
        if kind != "h":
            raise ValueError(f"not a DistinctBlocks text: {text[:16]!r}")
        return cls(int(math.log2(len(data))), data)
