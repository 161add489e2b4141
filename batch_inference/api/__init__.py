"""The Batch API server: OpenAI's and Anthropic's batch endpoints over the pipeline (docs/api.md).

Thin, like ``cli`` and ``defs``: every batch is one ``PipelineRun`` (``batches``), its state
is in storage (``store``), several batches share each model's pool by deadline and fairly
between projects (``fair``, ``admission``), ``usage`` and ``metrics`` say who used what, and
``server`` is the HTTP around them.
"""
