"""How a record becomes a request: the prompt source, sampling, per-record limits, response format.

Plain JSON (pydantic, extra=forbid, frozen): these travel inside a ``TaskSpec`` to the
workers. ``batch_inference.pool.protocol`` re-exports ``InferConfig`` and ``SamplingConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from batch_inference.engines.base import ResponseFormat, SamplingParams
from batch_inference.engines.structured import schema_check_error

Role = Literal["system", "developer", "user", "assistant"]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingConfig(_Wire):
    """Sampling on the wire; mirrors ``engines.SamplingParams`` field for field.

    ``seed`` is the run's *base* seed: each record gets ``derive_seed(seed, id, attempt)``
    so a retry samples differently but repeatably.
    """

    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)

    def to_params(self, *, seed: int | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for one record (``seed`` overrides the base)."""
        data = self.model_dump()
        if data["stop"] is not None:
            data["stop"] = list(data["stop"])
        data["seed"] = self.seed if seed is None else seed
        return SamplingParams(**data)


class SamplingLimits(_Wire):
    """Spec-level maxima for per-record overrides: a bad row cannot ask for 1M tokens."""

    max_tokens: int = Field(4096, ge=1, description="most tokens a record may ask for")
    temperature: float = Field(2.0, ge=0.0, description="highest temperature a record may ask for")
    stop: int = Field(4, ge=0, description="most stop strings a record may give")


class MessageTemplate(_Wire):
    """One chat turn built from record fields: ``content`` is a ``{field}`` template."""

    role: Role
    content: str


class JsonSchemaFormat(_Wire):
    """OpenAI's ``response_format.json_schema`` object."""

    name: str = Field("response", min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """Results are validated against it (``engines.structured``), so it must be a schema."""
        if (why := schema_check_error(schema)) is not None:
            raise ValueError(why)
        return schema


class ResponseFormatConfig(_Wire):
    """OpenAI's ``response_format``: ``{type: json_object}`` or ``{type: json_schema, json_schema: {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormatConfig:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format type 'json_schema' needs 'json_schema: {name, schema}'")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format type {self.type!r} takes no 'json_schema'")
        return self

    def to_format(self) -> ResponseFormat | None:
        """The engine's ``ResponseFormat`` (None for ``text``: nothing to constrain)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ResponseFormat("json_object")
        assert self.json_schema is not None
        return ResponseFormat("json_schema", orjson.dumps(self.json_schema.schema_, option=orjson.OPT_SORT_KEYS).decode())


class InferConfig(_Wire):
    """How to turn a record into a request (``prompting.RequestBuilder``).

    The prompt comes from exactly one source:

    * ``template``: a text prompt from record fields (``"Q: {question}"``);
    * ``messages``: chat turns built from record fields, rendered with the model's chat template;
    * neither: the record's own ``messages`` (chat) or ``prompt`` (text) field, as OpenAI
      Batch input gives them.

    ``system`` is prepended to chat prompts that have no system turn. A record's
    ``sampling_field`` (default ``sampling``) overrides ``sampling`` per record, within
    ``limits``; its ``response_format`` field overrides ``response_format``.

    ``null_fields`` says what a template placeholder whose value is null renders as: ``error``
    (the default: the record fails ``missing_field``, as when it lacks the field) or ``empty``.

    ``adapter`` is the LoRA adapter the requests run on (none: the base model); a record's
    ``adapter_field`` (default ``adapter``) names its own, one of ``adapters`` (the
    engine's adapters: the spec fills them in) or null for the base model.
    """

    template: str | None = Field(None, min_length=1)
    messages: tuple[MessageTemplate, ...] | None = Field(None, min_length=1)
    system: str | None = None
    sampling: SamplingConfig = SamplingConfig()
    sampling_field: str | None = "sampling"
    limits: SamplingLimits = SamplingLimits()
    response_format: ResponseFormatConfig | None = None
    adapter: str | None = Field(None, description="the LoRA adapter the requests run on (its engine's lora adapters); none: the base model")
    adapter_field: str | None = Field("adapter", description="the record field naming its own adapter (null: the base model)")
    adapters: tuple[str, ...] = Field((), description="the adapter names records may name (default: the engine's, set by the spec)")
    null_fields: Literal["error", "empty"] = Field(
        "error", description="a template field that is null: error (its record fails missing_field, as a missing one does) "
                             "or empty (renders as ''); never the string 'None'")
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: text from the prompt; embed: one vector per prompt (result: a list of floats), no decoding")
    dimensions: int | None = Field(None, ge=1, description="embed: keep each vector's first N (Matryoshka models only); "
                                                            "a record's own 'dimensions' field overrides it")

    @model_validator(mode="after")
    def _check(self) -> InferConfig:
        if self.template is not None and self.messages is not None:
            raise ValueError("give 'template' (a text prompt) or 'messages' (chat turns), not both")
        if self.system is not None and self.template is not None:
            raise ValueError("'system' applies to chat prompts: use 'messages' (or records with messages) instead of 'template'")
        if self.sampling.max_tokens > self.limits.max_tokens:
            raise ValueError(f"sampling.max_tokens {self.sampling.max_tokens} > limits.max_tokens {self.limits.max_tokens}")
        if self.task == "embed" and self.constrained:
            raise ValueError("response_format constrains generated text: an embedding (task: embed) generates none")
        if self.task == "embed" and self.adapter is not None:
            raise ValueError("adapter: an embedding engine serves no LoRA adapters (task: embed)")
        if self.task != "embed" and self.dimensions is not None:
            raise ValueError("dimensions is for embeddings: set task: embed, or leave dimensions out")
        return self

    @property
    def source(self) -> Literal["template", "messages", "record"]:
        if self.template is not None:
            return "template"
        return "messages" if self.messages is not None else "record"

    @property
    def constrained(self) -> bool:
        """True when the spec itself asks for constrained decoding."""
        return self.response_format is not None and self.response_format.type != "text"
