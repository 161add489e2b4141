"""The API server as its users meet it: `batch-inference api serve` in a child process on
127.0.0.1, and the official SDKs pointed at it."""

from __future__ import annotations

import json
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
from openai import OpenAI

TOKEN = "test-key-0123456789abcdef"
KEY_A1, KEY_A2, KEY_B = "team-a-key-1-0123456789", "team-a-key-2-0123456789", "team-b-key-0123456789ab"
PROJECTS = f"# before any [project]: project default\n{TOKEN}\n[team-a]\n{KEY_A1}\n{KEY_A2}\n[team-b]\n{KEY_B}\n"
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


def write_config(tmp_path: Path, models: dict[str, Any] | None = None, *, tokens: str | None = None, **keys: Any) -> Path:
    """api.yaml + its tokens file under ``tmp_path`` (relative paths, as users write them); ``tokens``: the
    tokens file's text (default: ``TOKEN`` alone, the format before projects)."""
    (tmp_path / "api-tokens").write_text(tokens if tokens is not None else f"# keys\n{TOKEN}\n")
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


SLOW = {"kind": "simulated", "simulated": {"latency_a_s": 0.06, "latency_b_s": 0.0, "output_tokens": 4}}


def slow_model(**keys: Any) -> dict[str, Any]:
    """A model whose batches take seconds (shards of 10, two in flight): time to cancel or kill one."""
    return {"tiny": {"engine": SLOW, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5, **keys}}


def client(server: Server, key: str = TOKEN) -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def submit(c: OpenAI, lines: list[dict[str, Any]], **kw: Any) -> Any:
    f = c.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=kw.pop("window", "24h"), **kw)


def wait_status(c: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 120.0) -> Any:
    return wait_for(lambda: (b := c.batches.retrieve(batch_id)).status in statuses and b, timeout_s=timeout_s,
                    what=f"batch {batch_id} to be {statuses}")


def lines_of(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()] if file_id else []


def delivered(c: OpenAI, batch: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The output and error lines of an ended batch, each custom_id checked to be in exactly one."""
    out, err = lines_of(c, batch.output_file_id), lines_of(c, batch.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert len(ids) == len(set(ids)), "a custom_id is in the files twice"
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)
    assert batch.request_counts.completed + batch.request_counts.failed == batch.request_counts.total == len(ids)
    return out, err
