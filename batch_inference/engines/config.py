"""Engine configuration: one pydantic model for every engine kind."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SimulatedOptions(BaseModel):
    """Cost model and fault injection of the simulated engine (benchmarks and scale tests)."""

    model_config = ConfigDict(extra="forbid")

    latency_a_s: float = Field(0.002, ge=0, description="fixed cost per generate() call, seconds")
    latency_b_s: float = Field(1e-5, ge=0, description="cost per batch token, seconds")
    padded: bool = Field(False, description="cost n x max(prompt+output tokens) instead of the sum")
    output_tokens: int = Field(16, ge=1, description="words of text per completion (capped by max_tokens)")
    approval_rate: float = Field(0.5, ge=0, le=1, description="P(output starts with APPROVED)")
    fail_on: str | None = Field(None, description="prompts containing this substring come back as errors")
    fail_batch_every: int | None = Field(None, ge=1, description="every Nth generate() call raises")


class VllmOptions(BaseModel):
    """Options passed to ``vllm.LLM``; ``extra`` goes through verbatim."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    enforce_eager: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)


# Engine kinds whose engines set ``structured_output = True``.
STRUCTURED_OUTPUT_KINDS = frozenset({"vllm"})


class EngineConfig(BaseModel):
    """Which engine to build and how. ``build_engine(EngineConfig(...))`` is the one factory."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["transformers", "vllm", "simulated"]
    model: str | None = Field(None, description="model directory (transformers, vllm)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(1, ge=1, description="torch.set_num_threads on CPU; None leaves torch's default")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's max_position_embeddings (4096 simulated)")
    seed: int = Field(0, description="engine-level seed (vLLM; simulated output salt)")
    simulated: SimulatedOptions = Field(default_factory=SimulatedOptions)
    vllm: VllmOptions = Field(default_factory=VllmOptions)

    @property
    def structured_output(self) -> bool:
        """Whether this engine kind constrains decoding to a response format (vLLM's
        structured outputs); known before the engine is built, so a spec can be refused."""
        return self.kind in STRUCTURED_OUTPUT_KINDS

    @model_validator(mode="after")
    def _needs_model(self) -> EngineConfig:
        if self.kind in ("transformers", "vllm") and not self.model:
            raise ValueError(f"engine kind {self.kind!r} needs 'model' (a model directory, e.g. from `batch-inference make-model DIR`)")
        return self
