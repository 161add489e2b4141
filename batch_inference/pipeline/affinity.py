"""Prefix affinity: the prefix family of each shard, so a pool sends a family to one worker.

Each worker's engine has its own prefix cache: records of one family (a document's
questions, a task type's few-shot block) spread over N workers compute their prefix up to
N times. The prefix-aware layout puts a family's records in one shard, or in consecutive
shards; this names each shard's family so ``PoolClient`` can send every shard of it to the
same worker (``TaskSpec.affinity``: the worker ``PoolClient`` gives the family at its first
task, a full worker passing its turn on).

A shard's family is its first record's prompt, signed by text (4 characters a token, no
tokenizer) over its first ``AFFINITY_TOKENS`` tokens: in a shard laid out in prefix order
the first record leads the shard's family, and a family that spills into the next shard
leads that one too. The judge phase reads its inferred shard, which holds the same
records in the same order, so a shard's judge task meets its infer task's worker.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batch_inference.engines.blocks import BLOCK_HASH_BYTES
from batch_inference.engines.chat import prompt_text
from batch_inference.prompting import InferConfig, RequestBuilder
from batch_inference.prompting.prefix import CharTokens, PrefixSigner
from batch_inference.storage import JsonlFile

log = logging.getLogger(__name__)

AFFINITY_TOKENS = 512  # the prefix that names a family: longer than a shared preamble, shorter than a document
READ_THREADS = 16  # shards whose first record is read at once (one small read each)


def family_key(prompt: Any, *, block_size: int = 16) -> str:
    """A prompt's family: the hash of its first ``AFFINITY_TOKENS`` tokens' deepest full block
    (names that whole prefix), or of the whole prompt when it is shorter than a block."""
    signer = PrefixSigner(CharTokens(), block_size=block_size, max_blocks=max(1, AFFINITY_TOKENS // block_size))
    blocks = signer.sign([prompt])[0].blocks
    if blocks:
        return blocks[-BLOCK_HASH_BYTES:].hex()
    return hashlib.blake2b(prompt_text(prompt).encode("utf-8", "surrogatepass"), digest_size=BLOCK_HASH_BYTES).hexdigest()


def shard_families(shards: list[tuple[int, JsonlFile]], infer: InferConfig, *, block_size: int = 16) -> dict[int, str]:
    """Each shard's family (blocking: one small read per shard, ``READ_THREADS`` at a time).

    A shard that cannot be read, is empty or whose first record has no prompt has none:
    its task goes to any worker (its own task reports what is wrong with it).
    """
    builder = RequestBuilder(infer)

    def one(item: tuple[int, JsonlFile]) -> tuple[int, str | None]:
        index, shard = item
        records = shard.iter_records_sync()
        try:
            first = next(records, None)
        except Exception as exc:  # noqa: BLE001 - routing only: the task reads it for real
            log.debug("affinity: cannot read the first record of %s: %s", shard.url, exc)
            return index, None
        finally:
            records.close()
        if not isinstance(first, dict):
            return index, None
        try:
            prompt = builder.prompt(first)
        except (KeyError, ValueError):
            return index, None
        return index, family_key(prompt, block_size=block_size)

    if not shards:
        return {}
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(shards)), thread_name_prefix="affinity") as pool:
        return {i: key for i, key in pool.map(one, shards) if key is not None}
