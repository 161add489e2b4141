"""Prefix affinity: the prefix family of each shard, so a pool sends a family to one worker.

Each worker's engine has its own prefix cache: records of one family (a document's
questions, a task type's few-shot block) spread over N workers compute their prefix up to
N times. The prefix-aware layout puts a family's records in one shard, or in consecutive
shards; this names each shard's family so ``PoolClient`` can send the shards of it to the
same worker while that keeps the workers' load even (``TaskSpec.affinity``).

A family is ``prompting.prefix``'s, the layout's own (the cuts end shards between the same
families): records sharing a block past the ``common`` blocks every record shares, named
by the chain hash of that block. So a template preamble, however long, names no family of
its own: the documents behind it do. A shard's family is its first record's, signed by the
layout's signer: in a shard laid out in prefix order the first record leads the shard's
family, and a family that spills into the next shard leads that one too. ``common`` is
the layout pass's (every input record's), else what the shards' first records share. The
judge phase reads its inferred shard, which holds the same records in the same order, so
a shard's judge task meets its infer task's family.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batch_inference.prompting import InferConfig, RequestBuilder
from batch_inference.prompting.prefix import PrefixSigner, common_blocks, family_key
from batch_inference.storage import JsonlFile

log = logging.getLogger(__name__)

READ_THREADS = 16  # shards whose first record is read at once (one small read each)


def shard_families(shards: list[tuple[int, JsonlFile]], infer: InferConfig, signer: PrefixSigner, *,
                   common: int | None = None) -> dict[int, str]:
    """Each shard's family (blocking: one small read per shard, ``READ_THREADS`` at a time).

    ``common``: the blocks every record of the input shares (the layout pass's count);
    None: what the shards' first records share. A shard that cannot be read, is empty,
    whose first record has no prompt, or whose prompt ends within the common prefix has
    none: its task goes to any worker (its own task reports what is wrong with it).
    """
    builder = RequestBuilder(infer)

    def one(item: tuple[int, JsonlFile]) -> tuple[int, Any]:
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
            return index, builder.prompt(first)
        except (KeyError, ValueError):
            return index, None

    if not shards:
        return {}
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(shards)), thread_name_prefix="affinity") as pool:
        prompts = [(i, p) for i, p in pool.map(one, shards) if p is not None]
    signed = [(i, sig.blocks) for (i, _), sig in zip(prompts, signer.sign([p for _, p in prompts]))]
    heads = common_blocks(blocks for _, blocks in signed)
    base = heads if common is None else min(common, heads)
    return {i: key for i, blocks in signed if (key := family_key(blocks, base)) is not None}
