"""The throughput limit, measured in the same run as the pipeline (issue 32 item 1).

The limit is what no order of the same requests can beat on the same engine and cache:
the raw bench engine (the same ``LLM`` object, the same KV-cache configuration the
pipeline's engine is built with) given **each distinct request once, in prefix order, in
one ``LLM.generate`` call**, its prefix cache emptied first. Every distinct prefix is then
computed once and every distinct request once; duplicates of a request are answered by
its one run, so the limit's records/s counts every input record.

Used by ``bench/workload_aware.py`` (one in-process engine) and ``bench/prefill_ideal.py``
(a local pool of one and of two workers), which report the pipeline's records/s against it
with and without the shard step (where the layout pass runs), beside the prefill-token
figures, named as such.

Imported as ``_limit`` (a bench script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def limit_order(ids: list[list[int]]) -> list[list[int]]:
    """Each distinct request once, in prefix order (token-id order: requests sharing a
    prefix are adjacent, a shorter request before the longer ones it prefixes)."""
    return [list(x) for x in sorted({tuple(x) for x in ids})]


def measure_limit(llm: Any, encode: Callable[[list[dict[str, Any]]], list[list[int]]], records: list[dict[str, Any]],
                  output: int) -> dict[str, Any]:
    """The limit on ``llm``: its cache emptied, ``records`` tokenised (timed, as ``LLM.generate``
    of text and the pipeline's phase tokenise too), each distinct request once in prefix order,
    one ``generate`` call, exactly ``output`` tokens each at temperature 0."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=output, min_tokens=output, temperature=0.0)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    ids = limit_order(encode(records))
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], sampling_params=sampling, use_tqdm=False)
    secs = time.perf_counter() - t0
    return {"records": len(records), "requests": len(ids), "prompt_tokens": sum(map(len, ids)),
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": secs, "records_s": len(records) / secs}


def against_limit(run: dict[str, Any], limit: dict[str, Any]) -> dict[str, float]:
    """A pipeline run's records/s against the limit: over its infer phase alone (``of_limit``)
    and with the shard step, where the layout pass runs, added to its wall (``of_limit_shard``)."""
    with_shard = run["records"] / (run["seconds"] + run.get("shard_s", 0.0))
    return {"records_s": run["records"] / run["seconds"], "records_s_shard": with_shard,
            "of_limit": run["records"] / run["seconds"] / limit["records_s"], "of_limit_shard": with_shard / limit["records_s"]}
