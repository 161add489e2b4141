"""``/v1/embeddings`` request lines: an OpenAI embeddings request line in, its response body out.

Plain functions over plain dicts, below the server, so the Batch API (its endpoint,
``api.endpoints.embeddings``) and the pipeline's OpenAI Batch reader and writer
(``prompting.openai_batch``) share one reading of the body:

- ``to_record``: an embeddings body (``input`` one string, or a list of one string;
  ``model``, ``encoding_format``, ``dimensions``, ``user``) -> the pipeline's native record
  (``id``, ``prompt``, ``dimensions``, ``openai: {url, model, encoding_format}``), or
  ``EmbeddingsRefusal`` naming the field it cannot honour: several inputs in one line (a
  batch line is one request; send one line per input), token-id input (the pipeline
  tokenises text itself), an empty string, an ``encoding_format`` other than ``float`` /
  ``base64``, a ``dimensions`` that is no positive integer. A ``dimensions`` the model
  cannot give (not Matryoshka, or not one of its sizes) fails that line alone when it runs
  (``engines.pooling``: ``bad_request``), as OpenAI's 400 would.
- ``response_body``: a result row -> OpenAI's response (``object: list``, ``data: [{object:
  embedding, index, embedding}]``, ``model``, ``usage: {prompt_tokens, total_tokens}``), the
  vector as floats or as base64 of its little-endian float32 bytes, as OpenAI encodes it.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

URL = "/v1/embeddings"
ENCODINGS = ("float", "base64")


class EmbeddingsRefusal(ValueError):
    """A body this server cannot honour: ``param`` is the field, the message says why (OpenAI's 400)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class EmbeddingsBody(BaseModel):
    """The body fields an embeddings request may carry; any other is kept (``extra``) so the
    caller can name it as unsupported."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Any = None
    encoding_format: Any = None
    dimensions: Any = None
    user: Any = None


class EmbeddingsLine(BaseModel):
    """A ``/v1/embeddings`` request line of an OpenAI Batch input file."""

    model_config = ConfigDict(extra="allow")

    custom_id: str = Field(min_length=1, strict=True)
    method: Literal["POST"] = "POST"
    url: Literal["/v1/embeddings"]
    body: EmbeddingsBody

    def refusal(self) -> EmbeddingsRefusal | None:
        try:
            to_record(self.custom_id, self.body.model_dump(exclude_unset=True))
        except EmbeddingsRefusal as exc:
            return exc
        return None

    def record(self) -> dict[str, Any]:
        """The native record (only its id when the body is refused: its file is refused anyway)."""
        try:
            return to_record(self.custom_id, self.body.model_dump(exclude_unset=True))
        except EmbeddingsRefusal:
            return {"id": self.custom_id}


def input_text(value: Any) -> str:
    """The one text a line embeds: ``input`` as a string, or a list holding one string."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise EmbeddingsRefusal("input", "input must be a non-empty string")
        return value
    if value is None:
        raise EmbeddingsRefusal("input", "input is required: the text to embed")
    token_ids = isinstance(value, list) and bool(value) and (
        all(isinstance(x, int) and not isinstance(x, bool) for x in value) or all(isinstance(x, list) for x in value))
    if token_ids:
        raise EmbeddingsRefusal("input", "input as token ids is not supported by this server: send the text "
                                         "(the pipeline tokenises it with the model's own tokenizer)")
    if isinstance(value, list) and len(value) > 1:
        raise EmbeddingsRefusal("input", f"input has {len(value)} items: a batch line embeds one input here; "
                                         "send one request line per input")
    raise EmbeddingsRefusal("input", f"input must be a string or a list of one string, got {type(value).__name__}")


def to_record(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The pipeline's input record of one embeddings request (``EmbeddingsRefusal`` otherwise)."""
    record: dict[str, Any] = {"id": custom_id, "prompt": input_text(body.get("input"))}
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ENCODINGS:
        raise EmbeddingsRefusal("encoding_format", f"encoding_format {fmt!r} is not one of {', '.join(ENCODINGS)}")
    dims = body.get("dimensions")
    if dims is not None:
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
            raise EmbeddingsRefusal("dimensions", f"dimensions {dims!r} must be an integer >= 1")
        record["dimensions"] = dims
    model = body.get("model")
    record["openai"] = {"url": URL, "model": model if isinstance(model, str) else None, "encoding_format": fmt or "float"}
    return record


def body_refusal(body: Any) -> tuple[str, str] | None:
    """``(param, why)`` of an embeddings body this server cannot honour, else None."""
    if not isinstance(body, dict):
        return "body", "body must be an object"
    try:
        to_record("-", body)
    except EmbeddingsRefusal as exc:
        return exc.param, str(exc)
    return None


def encode_vector(vector: Sequence[float], encoding_format: str = "float") -> list[float] | str:
    """The vector as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return [float(x) for x in vector]


def decode_vector(data: list[float] | str) -> list[float]:
    """``encode_vector`` undone (what a client does with a base64 embedding)."""
    if isinstance(data, str):
        raw = base64.b64decode(data)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return list(data)


def response_body(row: dict[str, Any], *, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response of a result row (``result``: its vector)."""
    openai = row.get("openai") or {}
    usage = row.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    vector = row.get("result") or []
    return {"object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": encode_vector(vector, openai.get("encoding_format") or "float")}],
            "model": openai.get("model") or model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def infer_keys(engine: Any) -> dict[str, Any]:
    """The spec's ``infer`` keys a model's batches need: ``task: embed`` on an embedding model
    (its ``engine.task``; ``engine`` an ``EngineConfig`` or its dict)."""
    task = engine.get("task") if isinstance(engine, dict) else getattr(engine, "task", None)
    return {"task": "embed"} if task == "embed" else {}


def endpoint_mismatch(endpoint: str, engine: Any, model: str) -> str | None:
    """Why a model cannot answer a batch's endpoint (an embedding model only embeddings, and
    embeddings only on one), else None."""
    embeds = bool(infer_keys(engine))
    if embeds and endpoint != URL:
        return f"model {model!r} is an embedding model (engine.task: embed): send its requests to {URL}"
    if not embeds and endpoint == URL:
        return f"model {model!r} generates text: {URL} needs an embedding model (engine.task: embed in the API config)"
    return None


__all__ = ["ENCODINGS", "URL", "EmbeddingsBody", "EmbeddingsLine", "EmbeddingsRefusal", "body_refusal", "decode_vector",
           "encode_vector", "endpoint_mismatch", "infer_keys", "input_text", "response_body", "to_record"]
