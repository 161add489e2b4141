"""Dagster wiring of human review at the round boundary (the domain lives in ``pipeline.review``)."""
