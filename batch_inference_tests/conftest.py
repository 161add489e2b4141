"""Shared fixtures. Each layer's fixtures live in batch_inference_tests/fixtures/."""

pytest_plugins = [
    "batch_inference_tests.fixtures.s3",
    "batch_inference_tests.fixtures.models",
    "batch_inference_tests.fixtures.pool",
    "batch_inference_tests.fixtures.postgres",
    "batch_inference_tests.fixtures.seaweedfs",
    "batch_inference_tests.fixtures.tiers",
    "pytester",  # test_tiers.py runs small suites through the tier rules
]
