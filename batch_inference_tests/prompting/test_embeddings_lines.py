"""``prompting.embeddings``: an OpenAI embeddings body to the pipeline's record and a result row
back to OpenAI's response body, with a clear refusal for each field it cannot honour."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from batch_inference.prompting.embeddings import (EmbeddingsRefusal, body_refusal, decode_vector, encode_vector, endpoint_mismatch,
                                                    response_body, to_record)
from batch_inference.prompting.openai_batch import OpenAIBatchReader, output_line


def test_a_body_becomes_the_pipelines_record() -> None:
    assert to_record("a", {"model": "m", "input": ["hello"], "dimensions": 32, "encoding_format": "base64", "user": "u"}) == {
        "id": "a", "prompt": "hello", "dimensions": 32, "openai": {"url": "/v1/embeddings", "model": "m", "encoding_format": "base64"}}
    assert to_record("b", {"input": "hi"})["openai"]["encoding_format"] == "float"


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"input": ["a", "b"]}, "input", "one request line per input"),
    ({"input": [1, 2, 3]}, "input", "token ids"),
    ({"input": [[1, 2]]}, "input", "token ids"),
    ({"input": ""}, "input", "non-empty"),
    ({}, "input", "required"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"input": "x", "dimensions": 0}, "dimensions", ">= 1"),
    ({"input": "x", "dimensions": True}, "dimensions", ">= 1"),
])
def test_what_cannot_be_honoured_is_refused_with_its_field(body: dict, param: str, match: str) -> None:
    with pytest.raises(EmbeddingsRefusal, match=match) as info:
        to_record("x", body)
    assert info.value.param == param
    assert body_refusal(body) == (param, str(info.value))
    assert body_refusal({"input": "x", "model": "m", "user": "u"}) is None


def test_base64_is_little_endian_float32_as_openai_sends_it() -> None:
    v = [0.5, -1.25, 3.0e-7]
    encoded = encode_vector(v, "base64")
    assert isinstance(encoded, str)
    assert np.array_equal(np.frombuffer(base64.b64decode(encoded), dtype="<f4"), np.asarray(v, dtype=np.float32))
    assert decode_vector(encoded) == [float(np.float32(x)) for x in v] and encode_vector(v) == v


def test_a_result_row_is_an_openai_embeddings_response_in_its_output_line() -> None:
    row = {"id": "a", "result": [0.6, 0.8], "usage": {"prompt_tokens": 7, "completion_tokens": 0},
           "openai": {"url": "/v1/embeddings", "model": "m", "encoding_format": "float"}}
    body = response_body(row, model="default")
    parsed = CreateEmbeddingResponse.model_validate(body)
    assert parsed.data[0].embedding == [0.6, 0.8] and parsed.model == "m" and parsed.usage.total_tokens == 7
    line = output_line(row, run="r", model="default", created=1)
    assert line["response"]["status_code"] == 200 and line["response"]["body"] == body and line["custom_id"] == "a"


def test_the_reader_takes_embeddings_lines_only_on_an_embedding_run() -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hi", "dimensions": 8}}
    reader = OpenAIBatchReader(embeds=True)
    assert reader.convert(line, 0)["prompt"] == "hi" and reader.error("f") is None
    generating = OpenAIBatchReader()
    generating.convert(line, 0)
    assert "/v1/embeddings needs infer.task: embed" in (generating.error("f") or "")
    bad = OpenAIBatchReader(embeds=True)
    bad.convert({**line, "body": {"input": ["a", "b"]}}, 0)
    assert "one request line per input" in (bad.error("f") or "")


def test_an_endpoint_and_a_models_task_must_agree() -> None:
    assert endpoint_mismatch("/v1/embeddings", {"task": "embed"}, "e") is None
    assert "is an embedding model" in (endpoint_mismatch("/v1/chat/completions", {"task": "embed"}, "e") or "")
    assert "generates text" in (endpoint_mismatch("/v1/embeddings", {"kind": "simulated"}, "c") or "")
