"""Planning and simulation: what a spec will cost and how long it will take, before and while it runs.

It sits above ``pipeline`` (it imports the spec, the summaries and the round policy, and
the profiler runs real pipelines); ``pipeline`` never imports it. A run that should show
an ETA after each round is given ``eta_after_round`` by whoever builds it (the CLI, the
Dagster steps). Modules, one job each:

* ``clock``: the virtual-time event loop;
* ``rates``: the workload and the engine-rate model (``engines.decode_model``, ``engines.profiles``);
* ``cluster``: the simulated replicas, slots, preemption and task retries;
* ``simulation``: a whole run in virtual time (``simulate``);
* ``sizing``: the input's record count and prompt tokens;
* ``profiling``: the engine profile file and ``measure_profile``;
* ``plan``: ``make_plan``, one simulation per strategy;
* ``progress``: the ETA after a round, planned vs actual.
"""

from __future__ import annotations

from batch_inference._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "VirtualClockLoop": "batch_inference.planning.clock",
    "run_virtual": "batch_inference.planning.clock",
    "Workload": "batch_inference.planning.rates",
    "EngineRates": "batch_inference.planning.rates",
    "engine_rates": "batch_inference.planning.rates",
    "Cluster": "batch_inference.planning.cluster",
    "Overheads": "batch_inference.planning.cluster",
    "SimResult": "batch_inference.planning.simulation",
    "simulate": "batch_inference.planning.simulation",
    "InputSize": "batch_inference.planning.sizing",
    "input_size": "batch_inference.planning.sizing",
    "EngineProfile": "batch_inference.planning.profiling",
    "measure_profile": "batch_inference.planning.profiling",
    "run_measure_profile": "batch_inference.planning.profiling",
    "RunPlan": "batch_inference.planning.plan",
    "StrategyPlan": "batch_inference.planning.plan",
    "make_plan": "batch_inference.planning.plan",
    "eta_after_round": "batch_inference.planning.progress",
    "planned_vs_actual": "batch_inference.planning.progress",
    "measured_phases": "batch_inference.planning.progress",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
