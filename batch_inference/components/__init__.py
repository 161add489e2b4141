"""Dagster components: ``BatchInferenceComponent`` puts a pipeline in a user's own ``dg`` project.

Registered through the ``dagster_dg_cli.registry_modules`` entry point (pyproject.toml), so
``dg list components`` shows it and ``dg scaffold defs batch_inference.BatchInferenceComponent
scoring`` writes its ``defs.yaml``.
"""

from batch_inference.components.batch_inference_component import BatchInferenceComponent, ScheduleModel

__all__ = ["BatchInferenceComponent", "ScheduleModel"]
