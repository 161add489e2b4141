"""The API server as its users meet it: `batch-inference api serve` in a child process on
127.0.0.1, and the official SDKs pointed at it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

TOKEN = "test-key-0123456789abcdef"
SIMULATED = {"kind": "simulated", "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "output_tokens": 4}}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str  # http://127.0.0.1:PORT
    log: Path
    config: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def write_config(tmp_path: Path, models: dict[str, Any] | None = None, **keys: Any) -> Path:
    """api.yaml + its tokens file under ``tmp_path`` (relative paths, as users write them)."""
    (tmp_path / "api-tokens").write_text(f"# keys\n{TOKEN}\n")
    data: dict[str, Any] = {"storage": "./api-data", "tokens_file": "./api-tokens",
                            "models": models or {"tiny": {"engine": SIMULATED, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}},
                            "tick_s": 0.2, **keys}
    path = tmp_path / "api.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start(config: Path, *, timeout_s: float = 60.0) -> Server:
    """``batch-inference api serve --config CONFIG --port 0``, ready when it says where it serves."""
    log = config.parent / f"server-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "batch_inference.cli.main", "api", "serve", "--config", str(config),
                                 "--host", "127.0.0.1", "--port", "0"], stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
        if m:
            return Server(proc, m.group(1), log, config)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout_s}s:\n{log.read_text()}")


@contextmanager
def serving(config: Path) -> Iterator[Server]:
    server = start(config)
    try:
        yield server
    finally:
        server.stop()


def chat_line(cid: str, content: str, model: str = "tiny", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


def wait_for(check: Any, *, timeout_s: float = 60.0, every_s: float = 0.1, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
