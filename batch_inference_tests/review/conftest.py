"""Fixtures for the review tests: a judged round waiting for review, review servers as real processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference.pipeline import PipelineSpec
from batch_inference_tests.pipeline.helpers import spec_dict
from batch_inference_tests.review.helpers import ReviewServer, judge_round


@pytest.fixture
def review_spec(tmp_path: Path) -> Callable[..., tuple[PipelineSpec, Path]]:
    """``review_spec(records=8, **overrides) -> (spec, spec file)`` with round 0 judged and waiting for people."""

    def make(records: int = 8, **overrides: Any) -> tuple[PipelineSpec, Path]:
        overrides.setdefault("judge", {"kind": "human"})
        data = spec_dict(tmp_path, records=records, **overrides)
        path = tmp_path / "spec.yaml"
        path.write_text(yaml.safe_dump(data))
        spec = PipelineSpec.parse(data)
        asyncio.run(judge_round(spec))
        return spec, path

    return make


@pytest.fixture
def review_server() -> Iterator[Callable[..., ReviewServer]]:
    started: list[ReviewServer] = []

    def start(spec_path: Path, *args: str) -> ReviewServer:
        server = ReviewServer(spec_path, *args).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
