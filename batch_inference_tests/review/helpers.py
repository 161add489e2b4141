"""Helpers for the review tests: reviewers' tokens, a judged round, the review server as a process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from batch_inference.pipeline import PipelineRun, PipelineSpec
from batch_inference.pipeline.runner import open_runner

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab",
          "carol": "carol-token-0123456789", "dave": "dave-token-0123456789a"}


async def judge_round(spec: PipelineSpec, r: int = 0) -> None:
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        if r == 0:
            await run.shard()
        await run.infer(r)
        await run.judge(r)


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
