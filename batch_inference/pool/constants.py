"""Numbers the workers' tasks run by that the layers above price or size by too.

The planner's simulation (``planning.simulation``) prices a retry task by how it runs; it
reads those numbers here rather than from the worker's task module (``pool.retry``), which
would tie the planner to the engines, the judging and the storage a task imports. Imports
nothing of the project.
"""

from __future__ import annotations

# A retry task whose judge has its own pool keeps this many chunks in flight (pool.retry):
# the next chunk generates here while the one before it is judged on the judge pool, so
# the two pools work at once instead of taking turns, and every wave keeps its chunk's
# size (splitting a chunk instead halves the waves, whose per-batch cost then ate the
# gain: bench/reports/judge_model.md). Bounded: at most this many chunks' samples live.
TAIL_CHUNKS_IN_FLIGHT = 2

__all__ = ["TAIL_CHUNKS_IN_FLIGHT"]
