"""Fixtures for the pipeline tests: a spec on the simulated engine (``helpers.spec_dict``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_inference.pipeline import PipelineSpec
from batch_inference_tests.pipeline.helpers import spec_dict


@pytest.fixture
def make_spec(tmp_path: Path):
    def make(**overrides: Any) -> PipelineSpec:
        return PipelineSpec.parse(spec_dict(tmp_path, **overrides))

    return make
