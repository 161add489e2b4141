"""``/v1/embeddings`` batches with the official `openai` SDK, unchanged, against `batch-inference api serve`
on the tiny embedding model: vectors as floats and as base64, ``dimensions`` where the model
allows it, and a clear error for each line it cannot honour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from batch_inference.engines import SamplingParams, build_engine
from batch_inference_tests.api.helpers import SIMULATED, client, delivered, jsonl, serving, wait_status, write_config

pytestmark = [pytest.mark.process, pytest.mark.slow]


def embed_line(cid: str, inp: Any, model: str = "embed", **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/embeddings", "body": {"model": model, "input": inp, **body}}


def test_an_embeddings_batch_end_to_end_with_the_sdk(tmp_path: Path, tiny_embed_dir: Path) -> None:
    engine = {"kind": "transformers", "model": str(tiny_embed_dir), "device": "cpu", "task": "embed"}
    config = write_config(tmp_path, {"embed": {"engine": engine, "shard_records": 8, "chunk_size": 4},
                                     "chat": {"engine": SIMULATED}})
    texts = [f"sentence {i} about the quick brown fox" for i in range(10)]
    lines = [embed_line(f"e{i}", t if i % 2 else [t], user="u1") for i, t in enumerate(texts)]
    lines += [embed_line("b64", texts[0], encoding_format="base64"), embed_line("d32", texts[0], dimensions=32),
              embed_line("d33", texts[0], dimensions=33), embed_line("two", ["a", "b"]), embed_line("ids", [1, 2, 3]),
              embed_line("fmt", "x", encoding_format="int8"), embed_line("chat-model", "x", model="chat")]
    with serving(config) as server:
        c = client(server)
        f = c.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        assert batch.endpoint == "/v1/embeddings"
        done = wait_status(c, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        out, err = delivered(c, done)
    ok = {x["custom_id"]: x["response"]["body"] for x in out if x["response"]["status_code"] == 200}
    # a line refused alone is OpenAI's HTTP 400 of that request (in the error file, as OpenAI files it)
    refused = {x["custom_id"]: x["response"]["body"]["error"] for x in out + err if x["response"] and x["response"]["status_code"] == 400}
    errors = {x["custom_id"]: x["error"] for x in err if x["error"] is not None}
    assert set(ok) == {f"e{i}" for i in range(10)} | {"b64", "d32"}

    own = build_engine(engine)  # the engine's own vectors for the same texts
    want = [c.embedding for c in own.generate(own.encode(texts), SamplingParams(embed=True))]
    for i in range(10):
        body = ok[f"e{i}"]
        parsed = CreateEmbeddingResponse.model_validate(body)  # the SDK's own type of an embeddings response
        assert parsed.object == "list" and parsed.model == "embed" and parsed.data[0].object == "embedding"
        assert parsed.data[0].index == 0 and np.allclose(parsed.data[0].embedding, want[i], atol=1e-6)
        assert parsed.usage.prompt_tokens == parsed.usage.total_tokens > 0
    b64 = np.frombuffer(__import__("base64").b64decode(ok["b64"]["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(b64, want[0], atol=1e-6)  # base64 of little-endian float32, as OpenAI sends it
    d32 = np.asarray(ok["d32"]["data"][0]["embedding"])
    assert d32.shape == (32,) and np.isclose(np.linalg.norm(d32), 1.0)  # truncated, then normalised
    assert errors["d33"]["code"] == "bad_request" and "one of [32, 64, 128]" in errors["d33"]["message"]
    assert refused["two"]["param"] == "input" and "one request line per input" in refused["two"]["message"]
    assert refused["ids"]["param"] == "input" and "token ids" in refused["ids"]["message"]
    assert refused["fmt"]["param"] == "encoding_format"
    assert errors["chat-model"]["code"] == "model_not_found" and "generates text" in errors["chat-model"]["message"]
