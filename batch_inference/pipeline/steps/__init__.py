"""The steps of a run, one module each (docs/ARCHITECTURE.md "the steps of a run").

``context`` holds what every step reads (spec, layout, ledger, the layout's signer);
``tasks`` builds a step's ``TaskSpec``; ``shard``, ``rounds`` (infer, streamed round 0,
judge), ``review``, ``decide`` (the decision, its ETA, recompaction), ``tail`` and
``finalize`` are the steps. ``pipeline.run.PipelineRun`` is the façade that calls them.
"""
