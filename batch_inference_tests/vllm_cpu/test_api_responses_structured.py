"""Real vLLM (the CPU build) behind the Batch API server: a ``/v1/responses`` batch whose lines
ask ``text.format`` json_schema gets schema-valid JSON in every ``output_text`` (the chat path's
structured output, reached through the Responses endpoint's mapping), with the official SDK.
``make test-vllm``; skipped where vllm is absent (the main venv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from batch_inference_tests.api.helpers import client, delivered, jsonl, serving, wait_status, write_config  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.process, pytest.mark.timeout(900)]

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["answer", "ok"], "additionalProperties": False}


def test_responses_text_format_json_schema_is_structured_output(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32", "max_model_len": 512,
              "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}}}
    config = write_config(tmp_path, {"tiny": {"engine": engine, "shard_records": 8, "chunk_size": 8}})
    fmt = {"format": {"type": "json_schema", "name": "reply", "schema": SCHEMA, "strict": True}}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
              "body": {"model": "tiny", "input": f"Record {i}: reply as JSON", "instructions": "JSON only",
                       "max_output_tokens": 256, "temperature": 1.0, "text": fmt}} for i in range(8)]
    with serving(config) as server:
        c = client(server)
        f = c.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
        done = wait_status(c, c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h").id,
                           ("completed", "failed"), timeout_s=600)
        assert done.status == "completed", done
        out, err = delivered(c, done)
        assert not err and len(out) == 8, err
        for line in out:
            body = line["response"]["body"]
            assert body["object"] == "response" and body["status"] == "completed", body
            value = json.loads(body["output"][0]["content"][0]["text"])  # random weights, constrained: every reply parses
            assert set(value) == {"answer", "ok"} and isinstance(value["answer"], int) and isinstance(value["ok"], bool), value
