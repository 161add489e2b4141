"""Dagster wiring of human review at the round boundary (the domain lives in ``batch_inference.review``)."""
