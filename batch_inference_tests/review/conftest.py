"""A judged round waiting for review, and review servers started as real processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batch_inference.pipeline import PipelineRun, PipelineSpec
from batch_inference.pipeline.runner import open_runner
from batch_inference_tests.pipeline.helpers import spec_dict

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab",
          "carol": "carol-token-0123456789", "dave": "dave-token-0123456789a"}


async def judge_round(spec: PipelineSpec, r: int = 0) -> None:
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        if r == 0:
            await run.shard()
        await run.infer(r)
        await run.judge(r)


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


class ReviewServer:
    """``batch-inference review`` as a child process; ``url`` once it listens."""

    def __init__(self, spec_path: Path, *args: str) -> None:
        self.cmd = [sys.executable, "-m", "batch_inference.cli.main", "review", str(spec_path), "--port", "0", *args]
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log: list[str] = []

    def start(self) -> ReviewServer:
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"review server exited ({self.proc.wait()}): {''.join(self.log)}")
            self.log.append(line)
            m = re.search(r"review page for run \S+: (http://\S+)", line)
            if m:
                self.url = m.group(1).rstrip("/")
                return self
        raise RuntimeError("review server did not come up: " + "".join(self.log))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


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
