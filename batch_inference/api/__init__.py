"""The Batch API server: OpenAI's and Anthropic's batch endpoints over the pipeline (docs/api.md).

Thin, like ``cli`` and ``defs``: every batch is one ``PipelineRun`` (``batches``), its state
is in storage (``store``), several batches share each model's pool fairly (``fair``), and
``server`` is the HTTP around them.
"""
